//! A device function served over vfio-user — the PVRDMA function, or the
//! virtio-rdma device as a virtio-pci function (docs/virtio-rdma.md
//! §13.3): its socket, the client connected to it, and the device's event
//! loop — one thread per device, waiting on the vfio-user socket and the
//! device's network port at once, no locks. A client that goes away leaves
//! the device reset and the socket ready for the next one; a second client
//! while one is connected is turned away. The client's socket is never
//! waited on: a message is taken as it comes, a reply sent as the client
//! takes it (and nothing more read until it has), and a client that takes
//! longer than the deadline for either is dropped, so a slow or stuck
//! client holds neither the device's thread nor its shutdown.

use std::{
    io,
    os::fd::{AsFd, BorrowedFd},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use nix::{
    poll::{PollFd, PollFlags, ppoll},
    sys::{
        eventfd::{EfdFlags, EventFd},
        time::TimeSpec,
    },
};
use vrdma_device::{Progress, publish::Publisher};
use vrdma_vfio_user::{
    Bus, Config, Function, Session,
    socket::{Connection, Listener, Received},
};

/// A PCI function with a vrdma device behind it, as the server runs it.
pub trait Served: Function {
    /// One round of the device (its network, its engine's timers) and
    /// what that produced for the guest.
    fn progress(&mut self, bus: &mut Bus<'_>) -> io::Result<Progress>;

    /// How soon the loop must come back when nothing else wakes it:
    /// `None`, only when something comes (the device waits for kicks);
    /// zero, at once (it spins: `vrdma_face::spin`); or after at most that
    /// long (a device that must look at the guest's memory, which cannot
    /// kick it, between spins).
    fn recheck(&self) -> Option<Duration>;

    /// The device clock (ns), the engine's deadlines' time base.
    fn now(&self) -> u64;

    /// Whether the client's socket carries only control now (commands,
    /// maps, resets) and no doorbells — they are in memory the device
    /// polls: a busy loop then looks at its descriptors every
    /// [`SOCKETS_EVERY`] instead of every turn. By default, while the
    /// device spins.
    fn quiet_socket(&self) -> bool {
        self.recheck() == Some(Duration::ZERO)
    }

    /// The descriptor that is readable when the device's network has
    /// input.
    fn fd(&self) -> BorrowedFd<'_>;

    /// The loop is about to sleep on [`Served::fd`].
    fn arm(&mut self);

    /// The client is gone: the device is reset for the next one (a new
    /// VM, or the same one after a restart: either resets it again before
    /// use).
    fn client_gone(&mut self);

    /// The device failed inside (a panic while serving it): the guest is
    /// told as the ABI says, then everything it made goes.
    fn fail(&mut self, bus: &mut Bus<'_>);

    /// The function's counters for `vrdma stat`.
    fn counters(&self) -> Vec<(String, u64)>;
}

/// Messages handled in one turn of the loop before the network gets its
/// turn again.
const MESSAGES_PER_TURN: usize = 64;

/// The longest the loop sleeps with nothing due (it looks at its stop
/// flag that often).
const IDLE: Duration = Duration::from_millis(200);

/// A device and its vfio-user socket.
#[derive(Debug)]
pub struct Server<F: Served> {
    listener: Listener,
    conn: Option<Connection>,
    session: Session,
    function: F,
    publisher: Option<Publisher>,
    /// Another thread's way to end the loop's wait at once.
    wake: Arc<EventFd>,
    /// Clients served since the start.
    pub clients: u64,
    /// Clients dropped for what they did: a malformed message, too many
    /// descriptors, too slow to send a message or to take a reply.
    pub dropped: u64,
    /// When the loop last looked at its descriptors (the device clock,
    /// see [`SOCKETS_EVERY`]).
    looked: u64,
}

/// While the device's doorbells are in memory it polls
/// ([`Served::quiet_socket`]) and it turns at once, how often its turns
/// look at the client's socket, the listener and the wake: a `ppoll` a
/// turn was a system call in every busy round, the largest part of a
/// polled device's cost per round after its network (the faces bench's
/// stepped mode). What the client sends then waits at most this long
/// more; a device about to sleep looks (it sleeps on them), and one whose
/// doorbells arrive on the socket (trapped, kicked) looks every turn.
pub const SOCKETS_EVERY: Duration = Duration::from_micros(50);

impl<F: Served> Server<F> {
    /// Serves `function` on a UNIX socket at `socket`, with the default
    /// [`Config`]; its counters are published under `name` (for `vrdma
    /// stat`).
    pub fn bind(socket: &Path, function: F, name: &str) -> io::Result<Self> {
        Self::bind_with(socket, function, name, &Config::default())
    }

    /// [`Server::bind`] with `config`.
    pub fn bind_with(socket: &Path, function: F, name: &str, config: &Config) -> io::Result<Self> {
        let listener = Listener::bind(socket, &config.socket)?;
        let session = Session::with_config(&function, config.dma.clone());
        Ok(Server {
            listener,
            conn: None,
            session,
            function,
            publisher: Publisher::new(name),
            wake: Arc::new(EventFd::from_flags(
                EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
            )?),
            clients: 0,
            dropped: 0,
            looked: 0,
        })
    }

    /// Ends the loop's current wait (and the next, if it is not waiting):
    /// for a thread that needs the device between two turns, or a stop
    /// that should not wait out the idle period.
    pub fn waker(&self) -> Waker {
        Waker(self.wake.clone())
    }

    pub fn function(&self) -> &F {
        &self.function
    }

    /// Names the device's network in its `vrdma stat` snapshots.
    pub fn set_network(&mut self, label: &str) {
        if let Some(p) = &mut self.publisher {
            p.set_network(label);
        }
    }

    pub fn function_mut(&mut self) -> &mut F {
        &mut self.function
    }

    /// Runs until `stop` is set or an unrecoverable error (the device's
    /// network port failing).
    pub fn run(&mut self, stop: &AtomicBool) -> io::Result<()> {
        // Its looks at the guest's memory (a device that cannot be
        // kicked) keep their intervals.
        crate::spin::precise_timers();
        while !stop.load(Ordering::Relaxed) {
            self.turn()?;
        }
        // The client's memory and descriptors go now, not with the
        // process.
        if self.conn.is_some() {
            self.disconnect();
        }
        self.publish(true);
        Ok(())
    }

    /// The device's counters for `vrdma stat`: the function's and the
    /// vfio-user server's (`vfio.*`: clients, messages, what the session
    /// holds of the process's resources, what it refused).
    pub fn counters(&self) -> Vec<(String, u64)> {
        counters(&self.function, &self.session, self.peers())
    }

    /// One turn: the device's round, then a wait for whatever comes next
    /// (the client, the network, the engine's next deadline, the client's
    /// deadline). A panic inside (a bug: no input should cause one) is
    /// reported and fails the device — the guest is told and everything it
    /// made goes, as in a reset — instead of ending the thread with the
    /// device silently gone; the client stays connected and may probe the
    /// device again.
    pub fn turn(&mut self) -> io::Result<()> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.serve_turn())) {
            Ok(r) => r,
            Err(_) => {
                // The panic hook has printed the panic's message.
                tracing::error!(
                    socket = %self.listener.path().display(),
                    "the device's thread panicked: the device is reset"
                );
                let mut bus = self.session.bus();
                self.function.fail(&mut bus);
                Ok(())
            }
        }
    }

    /// One turn that never sleeps: the device's round, then whatever the
    /// client or the listener has ready now. For a caller that advances
    /// the device and its driver in turn on one thread (the faces bench's
    /// stepped mode: each side's costs measured with no scheduler between
    /// them). Returns whether the round did work. A panic inside is not
    /// caught here (a caller stepping a device is a test or a bench).
    pub fn step(&mut self) -> io::Result<bool> {
        let p = {
            let mut bus = self.session.bus();
            self.function.progress(&mut bus)?
        };
        self.publish(false);
        let (client, listener) = self.look_now()?;
        if client {
            self.serve_client();
        }
        if listener {
            self.accept()?;
        }
        Ok(!p.is_idle())
    }

    fn serve_turn(&mut self) -> io::Result<()> {
        let p = {
            let mut bus = self.session.bus();
            self.function.progress(&mut bus)?
        };
        self.publish(false);
        let mut timeout = if !p.is_idle() {
            Duration::ZERO
        } else {
            match p.deadline {
                Some(t) => {
                    let now = self.function.now();
                    Duration::from_nanos(t.saturating_sub(now)).min(IDLE)
                }
                None => IDLE,
            }
        };
        if let Some(d) = self.function.recheck() {
            timeout = timeout.min(d);
        }
        if let Some(d) = self.conn.as_ref().and_then(Connection::deadline) {
            timeout = timeout.min(d.saturating_duration_since(Instant::now()));
        }
        // A shortage of descriptors waited out: the listener is not
        // watched meanwhile (it stays readable), the loop wakes to try
        // again.
        if let Some(t) = self.listener.retry_at() {
            timeout = timeout.min(t.saturating_duration_since(Instant::now()));
        }
        let (client, listener) = if timeout.is_zero() {
            self.look_now()?
        } else {
            // About to sleep on the device's descriptor.
            self.function.arm();
            self.looked = self.function.now();
            self.wait(timeout)?
        };
        // The client first: one that closed its connection (readable at
        // EOF) is gone before a newcomer is looked at, which would
        // otherwise be turned away as a second client.
        if client {
            self.serve_client();
        }
        if let Some(c) = &self.conn
            && let Err(e) = c.check_deadline(Instant::now())
        {
            self.drop_client(&e);
        }
        if listener
            || self
                .listener
                .retry_at()
                .is_some_and(|t| Instant::now() >= t)
        {
            self.accept()?;
        }
        Ok(())
    }

    /// A look at the descriptors without waiting — skipped while the socket
    /// carries no doorbells ([`Served::quiet_socket`]) and the last look
    /// was less than [`SOCKETS_EVERY`] ago.
    fn look_now(&mut self) -> io::Result<(bool, bool)> {
        let now = self.function.now();
        if self.function.quiet_socket()
            && now.saturating_sub(self.looked) < SOCKETS_EVERY.as_nanos() as u64
        {
            return Ok((false, false));
        }
        self.looked = now;
        self.wait(Duration::ZERO)
    }

    /// Waits until the client, the listener or the device has input (the
    /// client: room for its reply, when one waits), or `timeout`; which of
    /// the first two is ready. The listener is not watched while a
    /// shortage of descriptors is waited out.
    fn wait(&self, timeout: Duration) -> io::Result<(bool, bool)> {
        // ppoll: a device's next look can be microseconds away.
        let to = TimeSpec::from(timeout);
        let dev: BorrowedFd<'_> = self.function.fd();
        let listen = if self.listener.watching(Instant::now()) {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        // No client: its slot asks for nothing of the wake descriptor
        // again (an array, not a vector: a turn allocates nothing).
        let (conn, want) = match &self.conn {
            Some(c) if c.is_sending() => (c.as_fd(), PollFlags::POLLOUT),
            Some(c) => (c.as_fd(), PollFlags::POLLIN),
            None => (self.wake.as_fd(), PollFlags::empty()),
        };
        let mut fds = [
            PollFd::new(dev, PollFlags::POLLIN),
            PollFd::new(self.listener.as_fd(), listen),
            PollFd::new(self.wake.as_fd(), PollFlags::POLLIN),
            PollFd::new(conn, want),
        ];
        loop {
            match ppoll(&mut fds, Some(to), None) {
                Ok(_) => break,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        let ready = |f: &PollFd<'_>| {
            f.revents().is_some_and(|r| {
                r.intersects(
                    PollFlags::POLLIN
                        | PollFlags::POLLOUT
                        | PollFlags::POLLHUP
                        | PollFlags::POLLERR,
                )
            })
        };
        let listener = ready(&fds[1]);
        if ready(&fds[2]) {
            let _ = self.wake.read();
        }
        let client = self.conn.is_some() && ready(&fds[3]);
        Ok((client, listener))
    }

    fn accept(&mut self) -> io::Result<()> {
        let Some(c) = self.listener.accept()? else {
            return Ok(());
        };
        if self.conn.is_some() {
            // One client at a time: the newcomer is closed at once.
            tracing::warn!(socket = %self.listener.path().display(), "a second client was turned away");
            drop(c);
            return Ok(());
        }
        tracing::info!(socket = %self.listener.path().display(), "client connected");
        self.conn = Some(c);
        self.clients += 1;
        Ok(())
    }

    /// Sends what the client takes of a waiting reply, then handles the
    /// messages that came (until one's reply waits).
    fn serve_client(&mut self) {
        let Some(conn) = &mut self.conn else {
            return;
        };
        let mut served = || -> io::Result<bool> {
            conn.flush()?;
            for _ in 0..MESSAGES_PER_TURN {
                let m = match conn.receive(Instant::now())? {
                    Received::Message(m) => m,
                    Received::Pending => return Ok(true),
                    Received::Closed => return Ok(false),
                };
                let reply = self
                    .session
                    .handle(&mut self.function, &m.header, &m.payload, m.fds);
                if let Some(r) = reply {
                    conn.send(r.bytes, r.fd, Instant::now())?;
                }
            }
            Ok(true)
        };
        match served() {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(socket = %self.listener.path().display(), "client disconnected");
                self.disconnect();
            }
            Err(e) => self.drop_client(&e),
        }
    }

    /// Ends the connection of a client that misbehaved.
    fn drop_client(&mut self, e: &io::Error) {
        tracing::warn!(socket = %self.listener.path().display(), error = %e, "client dropped");
        self.dropped += 1;
        self.disconnect();
    }

    /// The client is gone: its memory and interrupts go with it, and the
    /// device is reset for the next one (a new VM, or the same one after a
    /// restart: either resets it again before use).
    fn disconnect(&mut self) {
        self.conn = None;
        self.session.disconnect(&mut self.function);
        self.function.client_gone();
    }

    fn publish(&mut self, last: bool) {
        let peers = self.peers();
        let Some(p) = &mut self.publisher else {
            return;
        };
        let now = self.function.now();
        let (f, session) = (&self.function, &self.session);
        p.publish(now, || counters(f, session, peers), last);
    }

    /// The clients served, dropped and refused, and the accepts that met a
    /// shortage.
    fn peers(&self) -> [u64; 4] {
        [
            self.clients,
            self.dropped,
            self.listener.refused(),
            self.listener.shortages(),
        ]
    }
}

/// The function's counters and the server's; `peers` are the clients
/// served, dropped and refused, and the accepts that met a shortage.
fn counters<F: Served>(f: &F, session: &Session, peers: [u64; 4]) -> Vec<(String, u64)> {
    let mut v = f.counters();
    let s = session.stats();
    let h = session.holdings();
    let [clients, dropped, refused, shortages] = peers;
    for (k, n) in [
        ("clients", clients),
        ("clients_dropped", dropped),
        ("peers_refused", refused),
        ("accept_shortages", shortages),
        ("messages", s.messages),
        ("errors", s.errors),
        ("dma_refused", s.dma_refused),
        ("dma_maps", h.dma_maps as u64),
        ("dma_bytes", h.dma_bytes),
        ("fds", h.fds as u64),
        ("dma_faults", h.dma_faults),
    ] {
        v.push((format!("vfio.{k}"), n));
    }
    v
}

/// Ends a server's wait from another thread ([`Server::waker`]).
#[derive(Clone, Debug)]
pub struct Waker(Arc<EventFd>);

impl Waker {
    pub fn wake(&self) {
        // A full counter already wakes the server.
        let _ = self.0.write(1);
    }
}

/// A flag a signal handler or another thread sets to stop servers.
pub type Stop = Arc<AtomicBool>;
