//! One virtio-rdma device served on a vhost-user socket: a connection at a
//! time, each with a new `VhostUserDaemon` (rust-vmm's daemon serves one
//! connection) around the same [`Backend`], whose device state outlives
//! them all.
//!
//! rust-vmm's daemon accepts the connection itself, so the accept cannot
//! go through `vrdma_sys::sock::Acceptor`; but a connection that could not
//! be started (no descriptor for the accept, the daemon's epoll or its
//! eventfds, no thread) is tried again on the same schedule
//! ([`vrdma_sys::sock::Backoff`]: 10 ms, doubled up to a second while it
//! keeps failing), the wait ended by a stop. The device goes on either
//! way; the connection waits in the listener's queue.

use std::{
    io,
    os::{fd::AsFd, unix::net::UnixListener},
    sync::{Arc, Mutex},
};

use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::eventfd::{EfdFlags, EventFd},
};
use vhost::vhost_user::Listener;
use vhost_user_backend::{ShutdownHandle, VhostUserDaemon};
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vrdma_device::Transport;
use vrdma_sys::sock::Backoff;

use crate::vhost::Backend;

/// A device's socket and its backend.
pub struct Server<T: Transport> {
    name: String,
    listener: UnixListener,
    backend: Arc<Backend<T>>,
    stop: Arc<Stop>,
}

impl<T: Transport> std::fmt::Debug for Server<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Stops a running [`Server`] from another thread.
pub struct Stop {
    wake: EventFd,
    current: Mutex<Option<ShutdownHandle>>,
    stopped: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop")
            .field("stopped", &self.stopped())
            .finish_non_exhaustive()
    }
}

impl Stop {
    /// The server ends its connection, if any, and returns from `run`.
    pub fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = self.wake.write(1);
        if let Some(h) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            h.shutdown();
        }
    }

    /// Ends the current connection only (as a VMM that goes away would):
    /// the server waits for the next.
    pub fn drop_connection(&self) {
        if let Some(h) = self
            .current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            h.shutdown();
        }
    }

    fn stopped(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl<T: Transport + Send + 'static> Server<T> {
    /// A server for `backend` on `listener` (bound by the caller, with the
    /// mode and owner it chose).
    pub fn new(name: &str, listener: UnixListener, backend: Arc<Backend<T>>) -> io::Result<Self> {
        let stop = Arc::new(Stop {
            wake: EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK)?,
            current: Mutex::new(None),
            stopped: std::sync::atomic::AtomicBool::new(false),
        });
        let s = stop.clone();
        backend.set_on_failure(Box::new(move || s.stop()));
        Ok(Server {
            name: name.to_string(),
            listener,
            backend,
            stop,
        })
    }

    pub fn backend(&self) -> &Arc<Backend<T>> {
        &self.backend
    }

    /// What stops it.
    pub fn stopper(&self) -> Arc<Stop> {
        self.stop.clone()
    }

    /// Serves connections one after another until stopped; an error if
    /// the device failed (its network went away).
    pub fn run(&self) -> io::Result<()> {
        let mut backoff = Backoff::new();
        loop {
            if self.stop.stopped() || !self.wait_for_client()? {
                return match self.backend.failure() {
                    Some(why) => Err(io::Error::other(why)),
                    None => Ok(()),
                };
            }
            match self.serve_one() {
                Ok(ended) => {
                    backoff.reset();
                    if let Err(e) = ended {
                        tracing::warn!(device = %self.name, error = %e, "vhost-user connection ended");
                    }
                }
                Err(e) => {
                    // A connection that could not even be started (no
                    // descriptors, no thread) is tried again later, and
                    // later still while that lasts: the listener stays
                    // readable meanwhile.
                    let wait = backoff.fail();
                    tracing::warn!(device = %self.name, error = %e, retry_in = ?wait, "vhost-user: no connection could be started now");
                    self.pause(wait)?;
                }
            }
            self.backend.disconnected();
        }
    }

    /// Waits `wait`, or until the server is stopped.
    fn pause(&self, wait: std::time::Duration) -> io::Result<()> {
        let ms = wait.as_millis().min(u128::from(u16::MAX));
        let to = PollTimeout::from(u16::try_from(ms).unwrap_or(u16::MAX));
        let mut fds = [PollFd::new(self.stop.wake.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, to) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Waits until a client connects (true) or the server is stopped.
    fn wait_for_client(&self) -> io::Result<bool> {
        loop {
            let mut fds = [
                PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.stop.wake.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
            if self.stop.stopped() {
                return Ok(false);
            }
            let ready = fds[0]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLIN));
            if ready {
                return Ok(true);
            }
        }
    }

    /// One connection, from accept to its end: how it ended, or (the outer
    /// error) why none could be started.
    fn serve_one(&self) -> io::Result<io::Result<()>> {
        let exit = self.backend.rearm_exit()?;
        let mut daemon = VhostUserDaemon::new(
            self.name.clone(),
            self.backend.clone(),
            GuestMemoryAtomic::new(GuestMemoryMmap::new()),
        )
        .map_err(|e| io::Error::other(e.to_string()))?;
        let handler = daemon
            .get_epoll_handlers()
            .into_iter()
            .next()
            .ok_or_else(|| io::Error::other("no worker"))?;
        self.backend.attach(handler)?;
        let mut listener = Listener::from(self.listener.try_clone()?);
        let started = daemon.start(&mut listener);
        let result = match started {
            Ok(()) => {
                *self.stop.current.lock().unwrap_or_else(|p| p.into_inner()) =
                    daemon.shutdown_handle();
                if self.stop.stopped() {
                    daemon.request_shutdown();
                }
                Ok(daemon.wait().map_err(|e| io::Error::other(e.to_string())))
            }
            Err(e) => Err(io::Error::other(e.to_string())),
        };
        *self.stop.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        // The worker goes with the connection: the daemon's drop joins it.
        let _ = exit.notify();
        drop(daemon);
        self.backend.close_handed_out();
        result
    }
}
