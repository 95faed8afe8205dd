//! One PVRDMA device served over vfio-user: the face core's server loop
//! (`vrdma_face::vfio`: the socket, the client, the device's thread) runs
//! the PVRDMA function.

use std::{io, os::fd::BorrowedFd};

use vrdma_device::{Progress, Transport};
use vrdma_face::vfio::Served;
use vrdma_vfio_user::Bus;

use crate::function::Pvrdma;

pub use vrdma_face::vfio::Stop;

/// A PVRDMA device and its vfio-user socket.
pub type Server<T> = vrdma_face::vfio::Server<Pvrdma<T>>;

impl<T: Transport> Served for Pvrdma<T> {
    fn progress(&mut self, bus: &mut Bus<'_>) -> io::Result<Progress> {
        Pvrdma::progress(self, bus)
    }

    fn recheck(&self) -> Option<std::time::Duration> {
        Pvrdma::recheck(self)
    }

    fn quiet_socket(&self) -> bool {
        // Shared doorbells: the driver's stores land in memory; the socket
        // brings commands and maps only.
        self.polling()
    }

    fn now(&self) -> u64 {
        // The round's reading (the loop asks right after the round, and a
        // reading costs a clock read a round), as virtio-pci's.
        self.device().clock()
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.device().fd()
    }

    fn arm(&mut self) {
        self.device_mut().transport_mut().arm();
    }

    fn client_gone(&mut self) {
        self.reset_device();
    }

    fn fail(&mut self, bus: &mut Bus<'_>) {
        Pvrdma::fail(self, bus);
    }

    fn counters(&self) -> Vec<(String, u64)> {
        Pvrdma::counters(self)
    }
}
