//! `vrdma serve`: RDMA devices for QEMU guests — PVRDMA over vfio-user
//! (`kind=pvrdma`, the stock `vmw_pvrdma` driver's), virtio-rdma over
//! vhost-user (`kind=virtio`, docs/virtio-rdma.md) — each on its own
//! socket, each with its Ethernet port between the guest's NIC (vmxnet3,
//! or the virtio-net sibling) and an uplink.
//!
//! One thread per device (a PVRDMA device and its engine never move
//! between threads: `vrdma_pvrdma::Server` is its whole event loop; a
//! virtio-rdma device's turns run in its vhost-user worker). The main
//! thread only waits for signals: SIGINT and SIGTERM stop every device;
//! a device whose port fails (its uplink gone) stops alone, said on
//! stderr, while the others go on serving.
//!
//! | module | what |
//! |---|---|
//! | `spec` | the `--device` strings parsed, the set checked |
//! | `open` | a device opened: port, switch, face, sockets |
//! | `confine` | the user, the run directory, the rendezvous grant, the confinement |
//!
//! [`run`] goes through its phases: the devices' specs checked, the
//! daemon's user and run directory, the signals blocked, each device
//! opened on a thread of its own, the grant written and the process
//! confined, then the devices released to serve until a signal or their
//! own end.

mod confine;
mod open;
mod spec;

use confine::Who;
use open::Opened;

pub use spec::{DeviceSpec, Kind, Uplink, check_networks, parse_mac};

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread::JoinHandle,
};

use anyhow::{Context, Result, anyhow, bail};
use nix::{
    sys::signal::{SigSet, Signal, kill},
    unistd::getpid,
};
use vrdma_fabric::shm::Switch;
use vrdma_pvrdma::caps::Limits;

use crate::{
    args::ServeArgs,
    sandbox::{self},
};

/// A device's thread, and the word that lets it serve.
pub(super) struct Running {
    pub(super) name: String,
    pub(super) thread: JoinHandle<Result<()>>,
    pub(super) go: mpsc::Sender<()>,
}

/// What `--print-capabilities` prints.
pub const CAPABILITIES: &str = r#"{"type": "rdma", "features": []}"#;

pub fn run(a: &ServeArgs) -> Result<()> {
    if a.print_capabilities {
        println!("{CAPABILITIES}");
        return Ok(());
    }
    let limits = a.caps.limits();
    limits.validate()?;
    let specs = spec::specs(a)?;
    let who = Who::of(a)?;
    let config = open::vfio_config(a)?;
    who.prepare()?;
    sandbox::raise_fd_limit();
    // Signals are taken by the main thread alone, synchronously: blocked
    // here, before any device thread exists (threads inherit the mask).
    let mut signals = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGUSR1] {
        signals.add(s);
    }
    signals.thread_block()?;

    // The devices' same-host medium.
    let switch = (!a.no_shm).then(Switch::new);
    let grants = confine::grant_entries(&specs);
    let (mut devices, done_rx) = Devices::new();
    let mut failed = None;
    for spec in specs {
        let opened = devices.start(spec, &limits, &config, switch.as_ref(), who.drop_caps);
        if let Err(e) = opened {
            failed = Some(e);
            break;
        }
    }
    let mut rendezvous = None;
    if failed.is_none()
        && switch.is_some()
        && let Err(e) = confine::grant(a, &grants, who.user.as_ref())
    {
        failed = Some(e);
    }
    if failed.is_none()
        && let Err(e) = confine::confine(who.user.as_ref(), who.drop_caps, a.seccomp, || {
            rendezvous = confine::join(switch.as_ref(), a)?;
            Ok(())
        })
    {
        failed = Some(e);
    }
    if let Some(e) = failed {
        devices.abort();
        return Err(e);
    }
    devices.release();
    let r = devices.serve(&signals, &done_rx);
    drop(rendezvous);
    r
}

/// The devices' threads and what stops them.
struct Devices {
    running: Vec<Running>,
    stop: Arc<AtomicBool>,
    /// The virtio-rdma servers' stops (their threads wait in vhost-user
    /// calls, not on the flag).
    stops: Arc<std::sync::Mutex<Vec<Arc<vrdma_virtio::server::Stop>>>>,
    /// A device thread that stops says which it was here, then wakes the
    /// main thread (SIGUSR1).
    done: mpsc::Sender<String>,
}

impl Devices {
    fn new() -> (Self, mpsc::Receiver<String>) {
        let (done, done_rx) = mpsc::channel::<String>();
        let devices = Devices {
            running: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            stops: Arc::default(),
            done,
        };
        (devices, done_rx)
    }

    /// Opens the device `spec` describes on a thread of its own, which
    /// then waits for [`Devices::release`] before it serves.
    fn start(
        &mut self,
        spec: DeviceSpec,
        limits: &Limits,
        config: &vrdma_vfio_user::Config,
        switch: Option<&Switch>,
        drop_caps: bool,
    ) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        let done = self.done.clone();
        let stop = self.stop.clone();
        let limits = limits.clone();
        let config = config.clone();
        let stops = self.stops.clone();
        let switch = switch.cloned();
        let name = spec.name.clone();
        let (go, go_rx) = mpsc::channel::<()>();
        let thread =
            std::thread::Builder::new()
                .name(spec.name.clone())
                .spawn(move || -> Result<()> {
                    let opened =
                        open::open(&spec, &limits, &config, switch.as_ref()).and_then(|s| {
                            if drop_caps {
                                sandbox::drop_thread_capabilities()?;
                            }
                            Ok(s)
                        });
                    let server = match opened {
                        Ok(s) => {
                            if let Opened::Virtio(v) = &s {
                                stops
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .push(v.stopper());
                            }
                            let _ = tx.send(Ok(()));
                            s
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return Ok(());
                        }
                    };
                    // Nothing is served before the whole process is
                    // confined (or if confining it failed: the sender
                    // is dropped).
                    if go_rx.recv().is_err() {
                        return Ok(());
                    }
                    let r = match server {
                        Opened::Pvrdma(mut s) => s.run(&stop).map_err(anyhow::Error::from),
                        Opened::VirtioPci(mut s) => s.run(&stop).map_err(anyhow::Error::from),
                        Opened::Virtio(s) => {
                            // Stopped before it began: its stop came too
                            // early to reach it.
                            if stop.load(Ordering::Relaxed) {
                                s.stopper().stop();
                            }
                            let r = s.run().map_err(anyhow::Error::from);
                            s.backend().publish_last();
                            r
                        }
                    };
                    let _ = done.send(spec.name.clone());
                    let _ = kill(getpid(), Signal::SIGUSR1);
                    r.with_context(|| format!("device {}", spec.name))
                })?;
        match rx.recv() {
            Ok(Ok(())) => {
                self.running.push(Running { name, thread, go });
                Ok(())
            }
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e.context(format!("device {name}")))
            }
            Err(_) => Err(anyhow!("device {name}: its thread died starting")),
        }
    }

    fn stop_all(&self) {
        self.stop.store(true, Ordering::Relaxed);
        for s in self.stops.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            s.stop();
        }
    }

    /// Start-up failed: every device opened so far stops unserved.
    fn abort(self) {
        self.stop_all();
        for r in self.running {
            drop(r.go);
            let _ = r.thread.join();
        }
    }

    /// The process is confined: every device may serve.
    fn release(&self) {
        for r in &self.running {
            let _ = r.go.send(());
            eprintln!("vrdma serve: {} ready", r.name);
        }
    }

    /// Serves until every device has stopped: SIGINT or SIGTERM stops
    /// them all; a device that stops on its own (SIGUSR1 from its thread)
    /// is joined while the others go on. Fails if any stopped on an error.
    fn serve(mut self, signals: &SigSet, done_rx: &mpsc::Receiver<String>) -> Result<()> {
        let mut errors = 0;
        while !self.running.is_empty() {
            let sig = signals.wait()?;
            if sig != Signal::SIGUSR1 {
                eprintln!("vrdma serve: {sig}, stopping");
                self.stop_all();
            }
            let stopped: Vec<String> = done_rx.try_iter().collect();
            let (done, live): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
                .into_iter()
                .partition(|r| stopped.contains(&r.name) || self.stop.load(Ordering::Relaxed));
            self.running = live;
            for r in done {
                match r.thread.join() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        errors += 1;
                        eprintln!("vrdma serve: {e:#}");
                    }
                    Err(_) => {
                        errors += 1;
                        eprintln!("vrdma serve: device {} failed", r.name);
                    }
                }
            }
        }
        if errors > 0 {
            bail!("{errors} device(s) stopped on an error");
        }
        Ok(())
    }
}
