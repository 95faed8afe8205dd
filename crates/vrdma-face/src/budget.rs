//! The object budget of a face's device: what a guest's objects may make
//! the engine hold (work queue slots, page lists, CQs kept in the engine),
//! by default derived from the guest memory the device maps
//! ([`ObjectBudget::Derived`]). The engine's limit follows the memory and
//! the engine: a face changes either through [`Budget`], which applies the
//! budget again each time.

use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::Engine;

/// An object budget kept applied to a device.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Budget(ObjectBudget);

impl Budget {
    /// `budget`, not yet applied to any device.
    pub const fn new(budget: ObjectBudget) -> Self {
        Budget(budget)
    }

    pub fn get(&self) -> ObjectBudget {
        self.0
    }

    /// A new budget for `device`, applied at once.
    pub fn set<T: Transport>(&mut self, budget: ObjectBudget, device: &mut Device<GuestMem, T>) {
        self.0 = budget;
        self.apply(device);
    }

    /// Sets the engine's limit for the memory the device maps now.
    pub fn apply<T: Transport>(&self, device: &mut Device<GuestMem, T>) {
        let limit = self.0.limit(device.mem().size());
        device.engine_mut().set_memory_limit(limit);
    }

    /// The device's engine replaced (a reset: every object of the old one
    /// goes with it), the budget applied to the new one.
    pub fn replace_engine<T: Transport>(&self, device: &mut Device<GuestMem, T>, engine: Engine) {
        *device.engine_mut() = engine;
        self.apply(device);
    }

    /// The guest's memory maps changed: the engine (its budget derived
    /// again), the CQ sinks (through `shared`) and the transport's lent
    /// pieces move to the new maps at once.
    pub fn remap<T: Transport>(
        &self,
        device: &mut Device<GuestMem, T>,
        shared: &crate::cq::SharedMem,
        mem: &vm_memory::GuestMemoryMmap<()>,
    ) {
        self.replace_memory(device, GuestMem::from_map(mem.clone()));
        if let Ok(guard) = shared.lock() {
            guard.replace(mem.clone());
        }
    }

    /// The device's memory replaced (the guest's maps changed), the budget
    /// derived again. Packets queued with payloads lent from the old
    /// memory leave first; payloads lent on from it to another device
    /// and not yet copied are read no more (its lease ends, after the
    /// copies under way).
    pub fn replace_memory<T: Transport>(&self, device: &mut Device<GuestMem, T>, mem: GuestMem) {
        let _ = device.flush();
        device.mem().revoke();
        *device.mem_mut() = mem;
        self.apply(device);
    }
}
