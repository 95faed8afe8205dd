//! The object budget of a face's device: what a guest's objects may make
//! the engine hold (work queue slots, page lists, CQs kept in the engine),
//! by default derived from the guest's memory ([`ObjectBudget::Derived`]):
//! its configured size ([`Budget::set_guest_size`]) where the operator gave
//! one, and never more than the device maps — what a VMM maps alone could
//! be a sparse file of any size. The engine's limit follows the memory and
//! the engine: a face changes either through [`Budget`], which applies the
//! budget again each time.

use vrdma_device::{Device, GuestMem, ObjectBudget, Transport};
use vrdma_engine::Engine;

/// An object budget kept applied to a device.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq)]
pub struct Budget {
    budget: ObjectBudget,
    /// The guest's RAM, as configured.
    guest: Option<u64>,
}

impl Budget {
    /// `budget`, not yet applied to any device, for a guest of unknown
    /// size.
    pub const fn new(budget: ObjectBudget) -> Self {
        Budget {
            budget,
            guest: None,
        }
    }

    pub fn get(&self) -> ObjectBudget {
        self.budget
    }

    /// The guest's configured size, if one was given.
    pub fn guest_size(&self) -> Option<u64> {
        self.guest
    }

    /// A new budget for `device`, applied at once.
    pub fn set<T: Transport>(&mut self, budget: ObjectBudget, device: &mut Device<GuestMem, T>) {
        self.budget = budget;
        self.apply(device);
    }

    /// The guest's RAM is `guest` bytes (or of unknown size): a derived
    /// budget follows it from now on, applied to `device` at once.
    pub fn set_guest_size<T: Transport>(
        &mut self,
        guest: Option<u64>,
        device: &mut Device<GuestMem, T>,
    ) {
        self.guest = guest;
        self.apply(device);
    }

    /// The engine's limit for `mapped` bytes of memory mapped.
    pub fn limit(&self, mapped: u64) -> Option<u64> {
        self.budget.limit(mapped, self.guest)
    }

    /// Sets the engine's limit for the memory the device maps now.
    pub fn apply<T: Transport>(&self, device: &mut Device<GuestMem, T>) {
        let limit = self.limit(device.mem().size());
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

#[cfg(test)]
mod tests {
    use vrdma_device::{DEFAULT_GUEST_SIZE, derived_budget};

    use super::*;

    const GIB: u64 = 1 << 30;

    /// A VMM that maps a sparse terabyte makes no more budget than the
    /// guest's configured size allows, or than the default size without
    /// one; a guest that maps less than its size gets what it maps.
    #[test]
    fn a_derived_budget_follows_the_configured_size_not_what_is_mapped() {
        let mut b = Budget::new(ObjectBudget::Derived);
        assert_eq!(b.limit(1 << 40), Some(derived_budget(DEFAULT_GUEST_SIZE)));
        assert_eq!(b.limit(GIB), Some(derived_budget(GIB)), "under the default");
        b.guest = Some(4 * GIB);
        assert_eq!(b.limit(1 << 40), Some(derived_budget(4 * GIB)));
        assert_eq!(
            b.limit(2 * GIB),
            Some(derived_budget(2 * GIB)),
            "the smaller"
        );
        assert_eq!(b.limit(0), Some(derived_budget(0)));
        // A configured size larger than the default counts.
        b.guest = Some(256 * GIB);
        assert_eq!(b.limit(1 << 40), Some(derived_budget(256 * GIB)));
        // Other budgets ignore both.
        b.budget = ObjectBudget::Fixed(5);
        assert_eq!(b.limit(1 << 40), Some(5));
        b.budget = ObjectBudget::Unlimited;
        assert_eq!(b.limit(1 << 40), None);
    }
}
