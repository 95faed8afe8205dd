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

    fn now(&self) -> u64 {
        self.device().now()
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
