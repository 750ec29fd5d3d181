//! Ranks as separate OS processes, talking over TCP: the process group behind
//! `memfit launch` (and torchrun or Slurm, which set the same environment).
//!
//! * **Rendezvous** ([`ProcessGroup::connect`]), from the environment torchrun
//!   sets ([`DistEnv`]: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//!   `MASTER_PORT`). Rank 0 listens on `MASTER_PORT` (the port after it when
//!   torchrun's agent holds `MASTER_PORT` for its own store,
//!   [`AGENT_STORE_ENV`]; or [`PORT_ENV`]) on every interface of its host,
//!   as torch's TCPStore does, so ranks on other hosts reach it at
//!   `MASTER_ADDR`; every other rank connects to `MASTER_ADDR` (retrying
//!   until the deadline), opens a listener of its own on the address it
//!   reached rank 0 from, and says hello (rank, world, port). Once all have,
//!   rank 0 sends everyone the table of addresses (each rank's as rank 0
//!   saw it, so its real address on its host's network, which the other
//!   hosts reach) and an opaque blob (how an NCCL unique id travels), and
//!   the ranks complete a full mesh: rank `j` connects to ranks `1..j` and
//!   accepts ranks `j+1..`. Every step has a deadline ([`TIMEOUT_ENV`]) and
//!   its error names the variable or the address at fault.
//! * **Transport**: one TCP connection per pair of ranks. Frames are `kind
//!   (u8), channel (u32), length (u64), payload`. A reader thread per peer
//!   drains its socket into per-(peer, channel) queues, so a send never waits
//!   for the receiver to post a receive (and two ranks sending each other
//!   large buffers cannot deadlock), and messages of one channel from one peer
//!   arrive in order. A channel is one collective group or one pipeline
//!   chain; its messages are matched by order, since every member makes the
//!   same calls in the same order.
//! * **Failure**: a peer whose connection closes (its process exited or was
//!   killed), a wait that passes the deadline, or a local
//!   [`ProcessGroup::abort`] (out of memory) marks the group failed: abort
//!   frames tell every peer why, and every pending and later collective of
//!   every rank returns at once, as the threaded `CpuComm`'s abortable
//!   barrier does. Once a rank knows of the failure it neither sends nor
//!   reads collective data any more: the ranks learn of it at different
//!   points (one mid-collective, with some sends done), so data still queued
//!   or in flight may belong to another collective than the one a rank is
//!   in, and reading it would mix collectives up. The control plane ([`ProcessGroup::gather_to_root`],
//!   [`ProcessGroup::release`]) keeps working after a failure, so rank 0 can
//!   still collect the ranks' reports and say which one failed.
//!
//! This module moves bytes; what they mean is its users': the collectives
//! and pipeline links on cpu buffers are the cpu backend's
//! (`backend::cpu::process`, bit-identical to the threaded `CpuComm`), and
//! NCCL rides on the rendezvous (`backend::cuda::nccl`).

use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::comm::{AbortHandle, Collective, Peer, PointToPoint};
use crate::error::{Error, Result};

/// Seconds any wait on another rank may take (rendezvous, a collective's
/// message, the final report) before the job is stopped.
pub const TIMEOUT_ENV: &str = "MEMFIT_DIST_TIMEOUT";
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The job's shared secret: `memfit launch` hands its ranks a random one
/// (or the one in its own environment, which every node of a multi-node
/// job must share). When set, rank 0 and every rank's listener drop a
/// connection whose hello does not carry it, naming its address.
pub const TOKEN_ENV: &str = "MEMFIT_LAUNCH_TOKEN";

/// How long a new connection has to say hello before it is dropped.
pub const HELLO_WAIT: Duration = Duration::from_secs(3);

/// This process's launch token, if it was given one.
fn launch_token() -> Option<String> {
    std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty())
}

/// Why a hello cannot join this job: its token is not ours (`None`: it may).
fn token_refused(mine: Option<&str>, theirs: &[u8]) -> Option<&'static str> {
    let mine = mine?;
    // Compared in full whatever differs first, so the time taken tells
    // nothing about the secret.
    let same = mine.len() == theirs.len()
        && mine.bytes().zip(theirs).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
    match (same, theirs.is_empty()) {
        (true, _) => None,
        (false, true) => Some("it presented no launch token"),
        (false, false) => Some("it presented another job's launch token"),
    }
}

/// The port rank 0 listens on, when it must not be `MASTER_PORT`.
pub const PORT_ENV: &str = "MEMFIT_MASTER_PORT";

/// torchrun sets this to `True` when its agent hosts its own store on
/// `MASTER_PORT` (torch.distributed.elastic); memfit's rank 0 then listens on
/// `MASTER_PORT + 1`.
pub const AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// Exit code of a rank whose job lost another rank (its connection closed,
/// or it sent nothing before the deadline).
pub const EXIT_PEER_LOST: i32 = 4;

/// The channel of the control plane (final reports); collective groups and
/// pipeline chains use the others.
const CONTROL: u32 = u32::MAX;

const MAGIC: &[u8; 8] = b"memfitpg";
const VERSION: u32 = 1;

/// Frame kinds.
const HELLO: u8 = 1;
const TABLE: u8 = 2;
const DATA: u8 = 3;
const ABORT: u8 = 4;
const BYE: u8 = 5;

/// Header: kind, channel, payload length.
const HEADER: usize = 1 + 4 + 8;

/// Largest payload a frame may announce: a corrupt or foreign stream fails
/// the job instead of allocating terabytes.
const MAX_PAYLOAD: u64 = 1 << 40;

/// One rank's place in a multi-process job, as torchrun sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub world: usize,
    /// This process's index on its node (the GPU it uses by default).
    pub local_rank: usize,
    /// Ranks on this node (`LOCAL_WORLD_SIZE`, else `WORLD_SIZE`): how many
    /// share its cores and memory.
    pub local_world: usize,
    pub master_addr: String,
    /// The port rank 0 listens on: `MASTER_PORT`, `MASTER_PORT + 1` under
    /// torchrun's agent store, or [`PORT_ENV`].
    pub master_port: u16,
    /// The variable a bad port is blamed on, and how the port was chosen.
    pub port_var: &'static str,
    pub port_source: String,
    pub timeout: Duration,
}

impl DistEnv {
    /// `None` when this process is not a rank of a multi-process job:
    /// neither `RANK` nor a `WORLD_SIZE` above 1 is set.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`DistEnv::from_env`] over any variable lookup (tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let var = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let num = |k: &str| -> Result<Option<usize>> {
            var(k)
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        Error::invalid_arg(k, format!("`{v}` is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let (rank, world) = match (num("RANK")?, num("WORLD_SIZE")?) {
            (None, None) => return Ok(None),
            (None, Some(w)) if w <= 1 => return Ok(None),
            (None, Some(w)) => {
                return Err(Error::invalid_arg(
                    "RANK",
                    format!(
                        "WORLD_SIZE is {w} but RANK is not set; every rank of a multi-process job needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (memfit launch and torchrun set them)"
                    ),
                ));
            }
            (Some(r), None) => {
                return Err(Error::invalid_arg(
                    "WORLD_SIZE",
                    format!(
                        "RANK is set ({r}) but WORLD_SIZE is not; every rank of a multi-process job needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (memfit launch and torchrun set them)"
                    ),
                ));
            }
            (Some(r), Some(w)) => (r, w),
        };
        if world == 0 {
            return Err(Error::invalid_arg("WORLD_SIZE", "must be at least 1"));
        }
        if rank >= world {
            return Err(Error::invalid_arg(
                "RANK",
                format!("{rank} is outside 0..{world} (WORLD_SIZE is {world})"),
            ));
        }
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        let local_world = num("LOCAL_WORLD_SIZE")?.unwrap_or(world).max(1);
        // A world of one talks to nobody: no address needed.
        let (master_addr, (master_port, port_var, port_source)) = if world == 1 {
            let addr = var("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
            (addr, (0, "MASTER_PORT", String::new()))
        } else {
            let addr = var("MASTER_ADDR").ok_or_else(|| {
                Error::invalid_arg(
                    "MASTER_ADDR",
                    "not set; rank 0's host name or address is needed for the rendezvous",
                )
            })?;
            let (port_var, port) = match var(PORT_ENV) {
                Some(p) => (PORT_ENV, p),
                None => (
                    "MASTER_PORT",
                    var("MASTER_PORT").ok_or_else(|| {
                        Error::invalid_arg(
                            "MASTER_PORT",
                            "not set; the port rank 0 listens on is needed for the rendezvous",
                        )
                    })?,
                ),
            };
            let port = match port.trim().parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => {
                    return Err(Error::invalid_arg(
                        port_var,
                        format!("`{port}` is not a port (1..=65535)"),
                    ));
                }
            };
            let agent = port_var == "MASTER_PORT"
                && var(AGENT_STORE_ENV).is_some_and(|v| v.trim() == "True");
            let chosen = match agent {
                false => (port, port_var, format!("{port_var}={port}")),
                true => {
                    let next = port.checked_add(1).ok_or_else(|| {
                        Error::invalid_arg(
                            PORT_ENV,
                            "torchrun's agent holds MASTER_PORT=65535 and memfit listens on the port after it; set MEMFIT_MASTER_PORT to a free port",
                        )
                    })?;
                    (
                        next,
                        "MASTER_PORT",
                        format!(
                            "MASTER_PORT+1={next}, as torchrun's agent holds MASTER_PORT={port} ({PORT_ENV} chooses another)"
                        ),
                    )
                }
            };
            (addr.trim().to_string(), chosen)
        };
        let timeout = match var(TIMEOUT_ENV) {
            None => DEFAULT_TIMEOUT,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Duration::from_secs_f64(s),
                _ => {
                    return Err(Error::invalid_arg(
                        TIMEOUT_ENV,
                        format!("`{v}` is not a positive number of seconds"),
                    ));
                }
            },
        };
        Ok(Some(DistEnv {
            rank,
            world,
            local_rank,
            local_world,
            master_addr,
            master_port,
            port_var,
            port_source,
            timeout,
        }))
    }
}

/// Why the group failed: the exit code it calls for, and the reason.
pub type Failure = (i32, String);

/// What the reader threads and the ranks' calls share.
#[derive(Default)]
struct State {
    queues: HashMap<(usize, u32), VecDeque<Vec<u8>>>,
    failure: Option<Failure>,
    /// Peers whose connection closed.
    closed: Vec<bool>,
    /// Set once this rank has finished training: a peer closing its
    /// connection is then the job ending, not a failure.
    finishing: bool,
    /// The job's exit code, from rank 0's goodbye.
    bye: Option<i32>,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the first failure; later ones are consequences.
    fn fail(&self, code: i32, why: String) -> bool {
        let mut st = self.lock();
        let first = st.failure.is_none();
        if first {
            st.failure = Some((code, why));
        }
        drop(st);
        self.cv.notify_all();
        first
    }
}

/// A connected group of processes: one TCP connection to every other rank.
/// Share it (`Arc`) among the rank's collective groups and pipeline links.
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// The write half of each peer's connection (`None` at this rank's index).
    writers: Vec<Option<Mutex<TcpStream>>>,
    shared: Arc<Shared>,
}

/// Writes one frame.
fn write_frame(s: &mut TcpStream, kind: u8, channel: u32, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; HEADER];
    head[0] = kind;
    head[1..5].copy_from_slice(&channel.to_le_bytes());
    head[5..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    if payload.len() <= 4096 {
        // One segment for small messages (scalars, control).
        let mut all = Vec::with_capacity(HEADER + payload.len());
        all.extend_from_slice(&head);
        all.extend_from_slice(payload);
        s.write_all(&all)
    } else {
        s.write_all(&head)?;
        s.write_all(payload)
    }
}

/// Fills `buf`, retrying reads that time out while `more()` allows. A
/// timeout never loses bytes already read (`read_exact` may).
fn read_full(s: &mut TcpStream, buf: &mut [u8], more: &dyn Fn() -> bool) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match s.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "connection closed",
                ));
            }
            Ok(k) => at += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if !more() {
                    return Err(io::Error::new(ErrorKind::TimedOut, "timed out"));
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads one frame: `(kind, channel, payload)`.
fn read_frame(s: &mut TcpStream, more: &dyn Fn() -> bool) -> io::Result<(u8, u32, Vec<u8>)> {
    let mut head = [0u8; HEADER];
    read_full(s, &mut head, more)?;
    let channel = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(head[5..].try_into().expect("8 bytes"));
    if len > MAX_PAYLOAD || !(HELLO..=BYE).contains(&head[0]) {
        return Err(io::Error::new(
            ErrorKind::InvalidData,
            "not a memfit process-group frame",
        ));
    }
    let mut payload = vec![0u8; len as usize];
    read_full(s, &mut payload, more)?;
    Ok((head[0], channel, payload))
}

/// Reads one frame before `deadline`.
fn read_frame_by(s: &mut TcpStream, deadline: Instant) -> io::Result<(u8, u32, Vec<u8>)> {
    s.set_read_timeout(Some(Duration::from_millis(50)))?;
    read_frame(s, &|| Instant::now() < deadline)
}

/// A hello: magic, version, rank, world, listening port, then the launch
/// token (the rest of the payload; empty without one).
fn hello(rank: usize, world: usize, port: u16, token: Option<&str>) -> Vec<u8> {
    let mut v = MAGIC.to_vec();
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&(rank as u32).to_le_bytes());
    v.extend_from_slice(&(world as u32).to_le_bytes());
    v.extend_from_slice(&port.to_le_bytes());
    v.extend_from_slice(token.unwrap_or_default().as_bytes());
    v
}

/// `(rank, world, port)` from a hello whose token is `mine` (if this
/// process has one), or why it is not one.
fn parse_hello(
    kind: u8,
    p: &[u8],
    mine: Option<&str>,
) -> std::result::Result<(usize, usize, u16), String> {
    if kind != HELLO || p.len() < 22 || &p[..8] != MAGIC {
        return Err("not a memfit rank".into());
    }
    let u32_at = |i: usize| u32::from_le_bytes(p[i..i + 4].try_into().expect("4 bytes"));
    if u32_at(8) != VERSION {
        return Err(format!(
            "a memfit rank speaking protocol version {} (this is {VERSION}): run the same memfit binary on every rank",
            u32_at(8)
        ));
    }
    if let Some(why) = token_refused(mine, &p[22..]) {
        return Err(format!("{why} ({TOKEN_ENV})"));
    }
    let port = u16::from_le_bytes(p[20..22].try_into().expect("2 bytes"));
    Ok((u32_at(12) as usize, u32_at(16) as usize, port))
}

/// The addresses of every rank (rank 0's unused) and the blob.
fn encode_table(addrs: &[Option<SocketAddr>], blob: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&(addrs.len() as u32).to_le_bytes());
    for a in addrs {
        let s = a.map(|a| a.to_string()).unwrap_or_default();
        v.extend_from_slice(&(s.len() as u32).to_le_bytes());
        v.extend_from_slice(s.as_bytes());
    }
    v.extend_from_slice(blob);
    v
}

fn decode_table(p: &[u8]) -> Option<(Vec<Option<SocketAddr>>, Vec<u8>)> {
    let take = |at: &mut usize, n: usize| -> Option<&[u8]> {
        let s = p.get(*at..*at + n)?;
        *at += n;
        Some(s)
    };
    let mut at = 0;
    let n = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?) as usize;
    let mut addrs = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let len = u32::from_le_bytes(take(&mut at, 4)?.try_into().ok()?) as usize;
        let s = std::str::from_utf8(take(&mut at, len)?).ok()?;
        addrs.push(if s.is_empty() { None } else { s.parse().ok() });
    }
    Some((addrs, p[at..].to_vec()))
}

/// Connects to the first of `addrs` that answers (a host name may resolve
/// to several), retrying refused connections until `deadline`.
fn connect_until(addrs: &[SocketAddr], deadline: Instant) -> io::Result<TcpStream> {
    let mut pause = Duration::from_millis(20);
    loop {
        let mut last = io::Error::new(ErrorKind::TimedOut, "timed out");
        for a in addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last);
            }
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        if Instant::now() + pause >= deadline {
            return Err(last);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

/// Accepts one connection before `deadline` (the listener is non-blocking).
fn accept_until(l: &TcpListener, deadline: Instant) -> io::Result<Option<TcpStream>> {
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                return Ok(Some(s));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The wildcard addresses rank 0 listens on `port` at, in the order it
/// tries them ([`ProcessGroup::listen`]): IPv6's (dual-stack), then IPv4's.
pub fn wildcard(port: u16) -> [SocketAddr; 2] {
    use std::net::{Ipv4Addr, Ipv6Addr};
    [
        SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port),
        SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port),
    ]
}

/// Why the table cannot work, if it has: ranks on rank 0's host that
/// reached it over loopback (`MASTER_ADDR` 127.0.0.1, `localhost`, or a
/// host name `/etc/hosts` maps to 127.0.1.1) listen on loopback, where the
/// ranks on other hosts cannot reach them.
fn unreachable_ranks(addrs: &[Option<SocketAddr>], env: &DistEnv) -> Option<String> {
    let on = |lo: bool| -> Vec<(usize, SocketAddr)> {
        addrs
            .iter()
            .enumerate()
            .filter_map(|(r, a)| a.map(|a| (r, a)))
            .filter(|(_, a)| a.ip().is_loopback() == lo)
            .collect()
    };
    let (lo, remote) = (on(true), on(false));
    let ((l, la), (r, ra)) = (lo.first()?, remote.first()?);
    Some(format!(
        "rank {l} reached rank 0 over loopback ({}, with MASTER_ADDR={}) but rank {r} joined from another host ({}), which cannot reach rank {l} there; give every rank the same MASTER_ADDR, an address or name of rank 0's host that every host reaches (not 127.0.0.1, localhost, or a host name that /etc/hosts maps to a loopback address)",
        la.ip(),
        env.master_addr,
        ra.ip()
    ))
}

fn ranks_list(v: impl Iterator<Item = usize>) -> String {
    v.map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

impl ProcessGroup {
    /// Joins the job `env` describes. On rank 0, `blob` makes the bytes sent
    /// to every rank with the address table (an NCCL unique id; empty when
    /// none is needed); every rank returns them.
    pub fn connect(
        env: &DistEnv,
        blob: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Arc<ProcessGroup>, Vec<u8>)> {
        let listener = if env.rank == 0 && env.world > 1 {
            Some(Self::listen(env)?)
        } else {
            None
        };
        Self::connect_with(env, listener, blob)
    }

    /// Rank 0's listener: `MASTER_PORT` on every interface of this host,
    /// or on loopback only when every rank runs on this host and reaches
    /// it at a loopback `MASTER_ADDR` (`memfit launch` on one node): then
    /// nothing outside the host can connect at all.
    ///
    /// torch's TCPStore (c10d `SocketListenOp`) listens the same way: on
    /// the wildcard address (`getaddrinfo(NULL, port, AI_PASSIVE)`), IPv6
    /// first (a dual-stack socket, which takes IPv4 connections too), then
    /// IPv4. Binding `MASTER_ADDR` itself would refuse every other host when
    /// it is 127.0.0.1, and rank 0 need not resolve its own name (a
    /// Kubernetes service, say, may not resolve until the pod is ready);
    /// the other ranks connect to `MASTER_ADDR`.
    pub fn listen(env: &DistEnv) -> Result<TcpListener> {
        let mut last = None;
        let local = Self::master_addrs(env)
            .ok()
            .filter(|a| env.local_world >= env.world && a.iter().all(|a| a.ip().is_loopback()));
        let addrs = local.unwrap_or_else(|| wildcard(env.master_port).to_vec());
        for a in addrs {
            match TcpListener::bind(a) {
                Ok(l) => return Ok(l),
                Err(e) => last = Some(e),
            }
        }
        let e = last.expect("two addresses tried");
        Err(Error::invalid_arg(
            env.port_var,
            format!(
                "rank 0 cannot listen on port {} (MASTER_ADDR={}, {}): {e}",
                env.master_port, env.master_addr, env.port_source
            ),
        ))
    }

    fn master_addrs(env: &DistEnv) -> Result<Vec<SocketAddr>> {
        let addrs: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
            .to_socket_addrs()
            .map_err(|e| {
                Error::invalid_arg(
                    "MASTER_ADDR",
                    format!("cannot resolve `{}`: {e}", env.master_addr),
                )
            })?
            .collect();
        if addrs.is_empty() {
            return Err(Error::invalid_arg(
                "MASTER_ADDR",
                format!("`{}` resolves to no address", env.master_addr),
            ));
        }
        Ok(addrs)
    }

    /// [`ProcessGroup::connect`] with rank 0's listener already bound (tests
    /// bind port 0 and hand the port to the other ranks).
    pub fn connect_with(
        env: &DistEnv,
        listener: Option<TcpListener>,
        blob: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Arc<ProcessGroup>, Vec<u8>)> {
        let deadline = Instant::now() + env.timeout;
        let (streams, blob) = match (env.world, env.rank) {
            (1, _) => (vec![None], blob()?),
            (_, 0) => {
                let l = listener.expect("rank 0 listens");
                Self::root_rendezvous(env, l, deadline, blob)?
            }
            _ => Self::rank_rendezvous(env, deadline)?,
        };
        Ok((Self::start(env, streams), blob))
    }

    /// Rank 0: wait for every rank's hello, then send the table.
    #[allow(clippy::type_complexity)]
    fn root_rendezvous(
        env: &DistEnv,
        l: TcpListener,
        deadline: Instant,
        blob: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<(Vec<Option<TcpStream>>, Vec<u8>)> {
        let world = env.world;
        let io = |e: io::Error| {
            Error::Unavailable(format!(
                "rank 0: rendezvous on {}:{} failed: {e}",
                env.master_addr, env.master_port
            ))
        };
        l.set_nonblocking(true).map_err(io)?;
        let token = launch_token();
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut addrs: Vec<Option<SocketAddr>> = vec![None; world];
        let mut joined = 1;
        while joined < world {
            let Some(mut s) = accept_until(&l, deadline).map_err(io)? else {
                let missing = ranks_list((1..world).filter(|&r| streams[r].is_none()));
                return Err(Error::Unavailable(format!(
                    "rank 0: only {joined} of {world} ranks joined within {:.0} s (missing: rank {missing}); check that every rank was started with WORLD_SIZE={world} and this MASTER_ADDR/MASTER_PORT ({}:{}), or raise {TIMEOUT_ENV}",
                    env.timeout.as_secs_f64(),
                    env.master_addr,
                    env.master_port
                )));
            };
            // A connection that does not say hello in time is not a rank.
            let peer = s.peer_addr().map_err(io)?;
            let hello_by = (Instant::now() + HELLO_WAIT).min(deadline);
            let Ok((kind, _, p)) = read_frame_by(&mut s, hello_by) else {
                eprintln!(
                    "memfit: rank 0: dropped a connection from {peer} to MASTER_PORT: it sent no hello within {} s",
                    HELLO_WAIT.as_secs()
                );
                continue;
            };
            let (r, w, port) = match parse_hello(kind, &p, token.as_deref()) {
                Ok(h) => h,
                Err(why) => {
                    eprintln!(
                        "memfit: rank 0: dropped a connection from {peer} to MASTER_PORT: {why}"
                    );
                    continue;
                }
            };
            if w != world {
                return Err(Error::invalid_arg(
                    "WORLD_SIZE",
                    format!(
                        "rank {r} (at {peer}) has WORLD_SIZE={w}, rank 0 has {world}; every rank must be given the same WORLD_SIZE"
                    ),
                ));
            }
            if r == 0 || r >= world || streams[r].is_some() {
                return Err(Error::invalid_arg(
                    "RANK",
                    format!(
                        "two processes (one at {peer}) claim RANK={r}; every rank of the job needs its own RANK in 0..{world}, and rank 0 is this one"
                    ),
                ));
            }
            // A dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d.
            addrs[r] = Some(SocketAddr::new(peer.ip().to_canonical(), port));
            streams[r] = Some(s);
            joined += 1;
        }
        if let Some(why) = unreachable_ranks(&addrs, env) {
            // Tell the ranks why, rather than let them wait for a table.
            let mut p = vec![2u8];
            p.extend_from_slice(why.as_bytes());
            for s in streams.iter_mut().flatten() {
                let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                let _ = write_frame(s, ABORT, 0, &p);
            }
            return Err(Error::invalid_arg("MASTER_ADDR", why));
        }
        let blob = blob()?;
        let table = encode_table(&addrs, &blob);
        for (r, s) in streams.iter_mut().enumerate() {
            if let Some(s) = s {
                s.set_write_timeout(Some(env.timeout)).map_err(io)?;
                write_frame(s, TABLE, 0, &table).map_err(|e| {
                    Error::Unavailable(format!(
                        "rank 0: sending the rendezvous table to rank {r} failed: {e}"
                    ))
                })?;
            }
        }
        Ok((streams, blob))
    }

    /// Rank j > 0: reach rank 0, learn the table, complete the mesh.
    #[allow(clippy::type_complexity)]
    fn rank_rendezvous(
        env: &DistEnv,
        deadline: Instant,
    ) -> Result<(Vec<Option<TcpStream>>, Vec<u8>)> {
        let (rank, world) = (env.rank, env.world);
        let token = launch_token();
        let master = Self::master_addrs(env)?;
        let mut root = match connect_until(&master, deadline) {
            Ok(s) => s,
            Err(last) => {
                return Err(Error::invalid_arg(
                    env.port_var,
                    format!(
                        "rank {rank} could not reach rank 0 at MASTER_ADDR={}, {} within {:.0} s ({}); is rank 0 running, and do all ranks have the same MASTER_ADDR and MASTER_PORT?",
                        env.master_addr,
                        env.port_source,
                        env.timeout.as_secs_f64(),
                        last
                    ),
                ));
            }
        };
        let io = |what: &str, e: io::Error| {
            Error::Unavailable(format!("rank {rank}: rendezvous failed while {what}: {e}"))
        };
        // Listen where rank 0 sees us, for the ranks above this one.
        let local = root
            .local_addr()
            .map_err(|e| io("reading the local address", e))?;
        let mine = TcpListener::bind(SocketAddr::new(local.ip(), 0))
            .map_err(|e| io("opening this rank's listener", e))?;
        let port = mine
            .local_addr()
            .map_err(|e| io("reading the listener's port", e))?
            .port();
        root.set_write_timeout(Some(env.timeout))
            .map_err(|e| io("configuring the connection", e))?;
        write_frame(
            &mut root,
            HELLO,
            0,
            &hello(rank, world, port, token.as_deref()),
        )
        .map_err(|e| io("greeting rank 0", e))?;
        let (kind, _, p) = read_frame_by(&mut root, deadline).map_err(|e| {
            let e = if e.kind() == ErrorKind::TimedOut {
                format!(
                    "not every rank joined within {:.0} s ({TIMEOUT_ENV})",
                    env.timeout.as_secs_f64()
                )
            } else {
                e.to_string()
            };
            Error::Unavailable(format!(
                "rank {rank}: waiting for rank 0's table failed: {e}"
            ))
        })?;
        let (addrs, blob) = match (kind, decode_table(&p)) {
            (TABLE, Some((a, b))) if a.len() == world => (a, b),
            (ABORT, _) => {
                return Err(Error::Unavailable(format!(
                    "rank 0 stopped the rendezvous: {}",
                    String::from_utf8_lossy(p.get(1..).unwrap_or_default())
                )));
            }
            _ => {
                return Err(Error::Unavailable(format!(
                    "rank {rank}: rank 0 sent no valid rendezvous table; run the same memfit binary on every rank"
                )));
            }
        };
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        streams[0] = Some(root);
        for (r, addr) in addrs.iter().enumerate().take(rank).skip(1) {
            let addr = addr.ok_or_else(|| {
                Error::Unavailable(format!(
                    "rank {rank}: the table has no address for rank {r}"
                ))
            })?;
            let mut s = connect_until(&[addr], deadline)
                .map_err(|e| io(&format!("connecting to rank {r} at {addr}"), e))?;
            s.set_write_timeout(Some(env.timeout))
                .map_err(|e| io("configuring a connection", e))?;
            write_frame(
                &mut s,
                HELLO,
                0,
                &hello(rank, world, port, token.as_deref()),
            )
            .map_err(|e| io(&format!("greeting rank {r}"), e))?;
            streams[r] = Some(s);
        }
        mine.set_nonblocking(true)
            .map_err(|e| io("configuring the listener", e))?;
        while let Some(missing) = (rank + 1..world).find(|&r| streams[r].is_none()) {
            let Some(mut s) =
                accept_until(&mine, deadline).map_err(|e| io("accepting a rank", e))?
            else {
                return Err(Error::Unavailable(format!(
                    "rank {rank}: rank {missing} did not connect within {:.0} s ({TIMEOUT_ENV})",
                    env.timeout.as_secs_f64()
                )));
            };
            let peer = s
                .peer_addr()
                .map_or_else(|_| "an unknown address".into(), |a| a.to_string());
            let hello_by = (Instant::now() + HELLO_WAIT).min(deadline);
            let Ok((kind, _, p)) = read_frame_by(&mut s, hello_by) else {
                eprintln!(
                    "memfit: rank {rank}: dropped a connection from {peer}: it sent no hello within {} s",
                    HELLO_WAIT.as_secs()
                );
                continue;
            };
            match parse_hello(kind, &p, token.as_deref()) {
                Ok((r, w, _)) if w == world && r > rank && r < world && streams[r].is_none() => {
                    streams[r] = Some(s);
                }
                Ok(_) => continue,
                Err(why) => {
                    eprintln!("memfit: rank {rank}: dropped a connection from {peer}: {why}");
                    continue;
                }
            }
        }
        Ok((streams, blob))
    }

    /// Starts a reader thread per peer.
    fn start(env: &DistEnv, streams: Vec<Option<TcpStream>>) -> Arc<ProcessGroup> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                closed: vec![false; env.world],
                ..State::default()
            }),
            cv: Condvar::new(),
        });
        let mut writers = Vec::with_capacity(env.world);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                writers.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let _ = s.set_write_timeout(Some(env.timeout));
            // The reader blocks in read(); dropping the group shuts the
            // socket down, which ends it.
            let _ = s.set_read_timeout(None);
            match s.try_clone() {
                Ok(r) => {
                    let sh = Arc::clone(&shared);
                    let me = env.rank;
                    std::thread::Builder::new()
                        .name(format!("memfit-pg-{me}<-{peer}"))
                        .spawn(move || read_loop(r, peer, sh))
                        .expect("spawning a reader thread");
                }
                Err(e) => {
                    shared.fail(
                        EXIT_PEER_LOST,
                        format!("rank {}: cannot read from rank {peer}: {e}", env.rank),
                    );
                }
            }
            writers.push(Some(Mutex::new(s)));
        }
        Arc::new(ProcessGroup {
            rank: env.rank,
            world: env.world,
            timeout: env.timeout,
            writers,
            shared,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Why the group failed, if it has.
    pub fn failure(&self) -> Option<Failure> {
        self.shared.lock().failure.clone()
    }

    /// Marks the group failed (this rank ran out of memory, or hit an
    /// error) and tells every peer why: their pending and later collectives
    /// return at once. Only the first failure is kept and sent.
    pub fn abort(&self, code: i32, why: impl Into<String>) {
        let why = why.into();
        if !self.shared.fail(code, why.clone()) {
            return;
        }
        let mut p = vec![code.clamp(0, 255) as u8];
        p.extend_from_slice(why.as_bytes());
        for w in self.writers.iter().flatten() {
            let mut s = w.lock().unwrap_or_else(|e| e.into_inner());
            let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
            let _ = write_frame(&mut s, ABORT, 0, &p);
            let _ = s.set_write_timeout(Some(self.timeout));
        }
    }

    /// A handle that aborts the group (an engine's failure elsewhere).
    pub fn abort_handle(self: &Arc<Self>) -> AbortHandle {
        let g = Arc::clone(self);
        Arc::new(move || {
            let me = g.rank;
            g.abort(1, format!("rank {me} aborted the job"))
        })
    }

    /// A message of the wrong size: the failure, if the group has failed
    /// meanwhile (returns); an engine bug in a healthy group (panics).
    pub(crate) fn wrong_size(&self, what: std::fmt::Arguments<'_>) {
        if self.shared.lock().failure.is_none() {
            panic!("engine bug: {what}");
        }
    }

    /// Sends one data frame to `peer`; `false`, sending nothing, once the
    /// group has failed (a peer still unaware of the failure must not get
    /// data from a rank that has stopped following the collectives' order:
    /// it waits, and the abort frame releases it); a failed send aborts the
    /// group.
    /// One collective or pipeline message to `peer` on `channel`, as
    /// [`ProcessGroup::send`] sends it.
    pub(crate) fn send_data(&self, peer: usize, channel: u32, payload: &[u8]) -> bool {
        self.send(peer, DATA, channel, payload)
    }

    fn send(&self, peer: usize, kind: u8, channel: u32, payload: &[u8]) -> bool {
        let w = self.writers[peer]
            .as_ref()
            .expect("engine bug: a process group message to this rank itself");
        if self.shared.lock().failure.is_some() {
            return false;
        }
        let res = {
            let mut s = w.lock().unwrap_or_else(|e| e.into_inner());
            write_frame(&mut s, kind, channel, payload)
        };
        match res {
            Ok(()) => true,
            Err(e) => {
                let why = match e.kind() {
                    ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                        "rank {}: rank {peer} took nothing for {:.0} s ({TIMEOUT_ENV}); stopping the job",
                        self.rank,
                        self.timeout.as_secs_f64()
                    ),
                    ErrorKind::BrokenPipe
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted => {
                        format!("rank {peer}'s connection closed: its process exited or was killed")
                    }
                    _ => format!("rank {}: sending to rank {peer} failed: {e}", self.rank),
                };
                self.abort(EXIT_PEER_LOST, why);
                false
            }
        }
    }

    /// The next message from `peer` on `channel`; `None` once the group has
    /// failed (at once, even with messages queued: after a failure the
    /// ranks no longer agree on which collective a message belongs to) or
    /// when nothing comes before the deadline (which fails the group).
    pub(crate) fn recv(&self, peer: usize, channel: u32) -> Option<Vec<u8>> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.shared.lock();
        loop {
            if st.failure.is_some() {
                return None;
            }
            // A message that arrived is good even if its sender has gone
            // since (it finished: a peer closing then is no failure).
            if let Some(m) = st
                .queues
                .get_mut(&(peer, channel))
                .and_then(VecDeque::pop_front)
            {
                return Some(m);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                self.abort(
                    EXIT_PEER_LOST,
                    format!(
                        "rank {}: nothing from rank {peer} for {:.0} s ({TIMEOUT_ENV}); stopping the job",
                        self.rank,
                        self.timeout.as_secs_f64()
                    ),
                );
                return None;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A control-plane message from `peer`, which may come after a failure;
    /// `Err` when the peer is gone or silent past the deadline.
    fn recv_control(&self, peer: usize, deadline: Instant) -> std::result::Result<Vec<u8>, String> {
        let mut st = self.shared.lock();
        loop {
            if let Some(m) = st
                .queues
                .get_mut(&(peer, CONTROL))
                .and_then(VecDeque::pop_front)
            {
                return Ok(m);
            }
            if st.closed[peer] {
                return Err(format!("rank {peer} exited before sending its report"));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!(
                    "rank {peer} sent no report within {:.0} s ({TIMEOUT_ENV})",
                    self.timeout.as_secs_f64()
                ));
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The end of the job: rank 0 gets every rank's `mine`, in rank order
    /// (an `Err` for a rank that is gone); the other ranks send theirs and
    /// get `None`. Works after a failure too.
    pub fn gather_to_root(
        &self,
        mine: Vec<u8>,
    ) -> Option<Vec<std::result::Result<Vec<u8>, String>>> {
        self.shared.lock().finishing = true;
        if self.rank != 0 {
            let _ = self.writers[0].as_ref().map(|w| {
                let mut s = w.lock().unwrap_or_else(|e| e.into_inner());
                write_frame(&mut s, DATA, CONTROL, &mine)
            });
            return None;
        }
        // One deadline for all: a job of many lost ranks still ends in time.
        let deadline = Instant::now() + self.timeout;
        let mut out = Vec::with_capacity(self.world);
        out.push(Ok(mine));
        for peer in 1..self.world {
            out.push(self.recv_control(peer, deadline));
        }
        Some(out)
    }

    /// Rank 0: tells every rank the job is over and its exit code (call it
    /// once rank 0 has printed the report: the launcher may stop rank 0 as
    /// soon as another rank exits). Other ranks: waits for that word and
    /// returns the code (`None` if rank 0 is gone).
    pub fn release(&self, code: i32) -> Option<i32> {
        self.shared.lock().finishing = true;
        if self.rank == 0 {
            for w in self.writers.iter().flatten() {
                let mut s = w.lock().unwrap_or_else(|e| e.into_inner());
                let _ = write_frame(&mut s, BYE, CONTROL, &code.to_le_bytes());
            }
            return Some(code);
        }
        // Rank 0 may still be waiting for a silent rank's report (one
        // timeout) before it prints and says goodbye.
        let deadline = Instant::now() + 2 * self.timeout + Duration::from_secs(5);
        let mut st = self.shared.lock();
        loop {
            if let Some(c) = st.bye {
                return Some(c);
            }
            let now = Instant::now();
            if st.closed[0] || now >= deadline {
                return None;
            }
            st = self
                .shared
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Panics on the control plane's channel: collectives and pipeline
    /// links (`backend::cpu::process`) take any other.
    pub(crate) fn check_channel(channel: u32) {
        assert!(
            channel != CONTROL,
            "engine bug: channel {channel} is reserved"
        );
    }
}

impl Drop for ProcessGroup {
    /// Closes every connection, which ends the reader threads (and tells
    /// the peers this rank is gone).
    fn drop(&mut self) {
        for w in self.writers.iter().flatten() {
            let s = w.lock().unwrap_or_else(|e| e.into_inner());
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// One peer's reader: frames into the queues until the connection ends.
fn read_loop(mut s: TcpStream, peer: usize, sh: Arc<Shared>) {
    loop {
        match read_frame(&mut s, &|| true) {
            Ok((DATA, channel, payload)) => {
                sh.lock()
                    .queues
                    .entry((peer, channel))
                    .or_default()
                    .push_back(payload);
                sh.cv.notify_all();
            }
            Ok((ABORT, _, p)) => {
                let code = p.first().map_or(1, |&c| c as i32);
                let why = String::from_utf8_lossy(p.get(1..).unwrap_or_default()).into_owned();
                sh.fail(code, why);
            }
            Ok((BYE, _, p)) => {
                let code = p
                    .get(..4)
                    .map_or(0, |b| i32::from_le_bytes(b.try_into().expect("4 bytes")));
                sh.lock().bye = Some(code);
                sh.cv.notify_all();
            }
            Ok(_) => {}
            Err(e) => {
                let mut st = sh.lock();
                st.closed[peer] = true;
                let finishing = st.finishing;
                drop(st);
                if !finishing {
                    let why = match e.kind() {
                        ErrorKind::UnexpectedEof
                        | ErrorKind::ConnectionReset
                        | ErrorKind::ConnectionAborted => format!(
                            "rank {peer}'s connection closed: its process exited or was killed"
                        ),
                        _ => format!("reading from rank {peer} failed: {e}"),
                    };
                    sh.fail(EXIT_PEER_LOST, why);
                } else {
                    sh.cv.notify_all();
                }
                return;
            }
        }
    }
}

/// Stands in for another process's link where code that wires every rank
/// of a job (`engine::cluster::links`) is used to wire one: it is dropped
/// unused, and any use is an engine bug.
pub struct Elsewhere;

impl<Buf> Collective<Buf> for Elsewhere {
    fn rank(&self) -> usize {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn world(&self) -> usize {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn all_reduce_sum(&mut self, _: &mut Buf, _: usize) {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn reduce_scatter_sum(&mut self, _: &mut Buf, _: &Buf, _: usize) {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn all_gather(&mut self, _: &mut Buf, _: &Buf, _: usize) {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn broadcast(&mut self, _: &mut Buf, _: usize, _: usize) {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn all_to_all(&mut self, _: &mut Buf, _: &Buf, _: &[usize]) {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn all_reduce_scalar(&mut self, _: f64) -> f64 {
        unreachable!("engine bug: a collective of a rank in another process")
    }
    fn abort_handle(&self) -> AbortHandle {
        Arc::new(|| {})
    }
}

impl<Buf> PointToPoint<Buf> for Elsewhere {
    fn send(&mut self, _: Peer, _: &Buf, _: usize) {
        unreachable!("engine bug: a pipeline link of a rank in another process")
    }
    fn recv(&mut self, _: Peer, _: &mut Buf, _: usize) {
        unreachable!("engine bug: a pipeline link of a rank in another process")
    }
    fn abort_handle(&self) -> AbortHandle {
        Arc::new(|| {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DType;
    use crate::backend::cpu::CpuBuf;
    use crate::backend::cpu::comm::cpu_group;
    use crate::backend::cpu::process::{ProcessComm, ProcessP2p};
    use half::{bf16, f16};

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world,
            local_rank: rank,
            local_world: world,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            port_var: "MASTER_PORT",
            port_source: format!("MASTER_PORT={port}"),
            timeout: Duration::from_secs(20),
        }
    }

    /// One TCP process group per thread on localhost; `f(rank, group)` on each.
    fn on_groups<R: Send>(
        world: usize,
        blob: &[u8],
        f: impl Fn(usize, Arc<ProcessGroup>, Vec<u8>) -> R + Sync,
    ) -> Vec<R> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let mut l = Some(l);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    let listener = if r == 0 { l.take() } else { None };
                    let f = &f;
                    let blob = blob.to_vec();
                    s.spawn(move || {
                        let (g, b) =
                            ProcessGroup::connect_with(&env(r, world, port), listener, || Ok(blob))
                                .unwrap();
                        f(r, g, b)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The end of a job, as `launch::rank_main` ends it: nobody closes its
    /// connections while another rank may still be receiving.
    fn end(g: &ProcessGroup) {
        g.gather_to_root(Vec::new());
        g.release(0);
    }

    /// Runs `f(comm)` on threaded CpuComm ranks; results in rank order.
    fn on_cpu<R: Send>(
        world: usize,
        f: impl Fn(&mut dyn Collective<CpuBuf>) -> R + Sync,
    ) -> Vec<R> {
        let comms = cpu_group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    let f = &f;
                    s.spawn(move || f(&mut c))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// Random floats of mixed magnitude (sums that round differently in
    /// another order).
    fn random(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                let m = (xorshift(&mut s) % 2_000_001) as f32 / 1e6 - 1.0;
                let e = (xorshift(&mut s) % 9) as i32 - 4;
                m * 10f32.powi(e)
            })
            .collect()
    }

    fn buf(dt: DType, v: &[f32]) -> CpuBuf {
        match dt {
            DType::F32 => CpuBuf::F32(v.to_vec()),
            DType::Bf16 => CpuBuf::Bf16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
            DType::F16 => CpuBuf::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            _ => unreachable!(),
        }
    }

    /// A buffer's bits, whatever its dtype.
    fn bits(b: &CpuBuf) -> Vec<u32> {
        match b {
            CpuBuf::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            CpuBuf::Bf16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            CpuBuf::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            _ => unreachable!(),
        }
    }

    /// Every collective on random inputs, as the rank's bits: the same
    /// script for the process group and for CpuComm.
    fn script(c: &mut dyn Collective<CpuBuf>, seed: u64) -> Vec<Vec<u32>> {
        let (rank, world) = (c.rank(), c.world());
        let mut out = Vec::new();
        for (k, dt) in [DType::F32, DType::Bf16, DType::F16]
            .into_iter()
            .enumerate()
        {
            let seed = seed + 1000 * k as u64;
            let n = 37 + k;
            // all-reduce, a tail beyond n left alone
            let mut b = buf(dt, &random(seed + rank as u64, n + 3));
            c.all_reduce_sum(&mut b, n);
            out.push(bits(&b));
            // reduce-scatter
            let shard = 5 + k;
            let inp = buf(dt, &random(seed + 10 + rank as u64, world * shard));
            let mut rs = buf(dt, &random(seed + 20, shard + 1));
            c.reduce_scatter_sum(&mut rs, &inp, shard);
            out.push(bits(&rs));
            // all-gather
            let mine = buf(dt, &random(seed + 30 + rank as u64, shard));
            let mut ag = buf(dt, &vec![0.0; world * shard + 2]);
            c.all_gather(&mut ag, &mine, shard);
            out.push(bits(&ag));
            // broadcast from every root in turn
            for root in 0..world {
                let mut b = buf(dt, &random(seed + 40 + rank as u64, 9));
                c.broadcast(&mut b, 7, root);
                out.push(bits(&b));
            }
            // empty calls keep the ranks in step too
            let mut e = buf(dt, &[]);
            c.all_reduce_sum(&mut e, 0);
        }
        let s = c.all_reduce_scalar(random(seed + 50 + rank as u64, 1)[0] as f64 * 0.1);
        out.push(vec![(s.to_bits() >> 32) as u32, s.to_bits() as u32]);
        out
    }

    #[test]
    fn collectives_match_cpu_comm_bit_for_bit() {
        for world in [1, 2, 3, 4] {
            for seed in [1u64, 77] {
                let want = on_cpu(world, |c| script(c, seed));
                let got = on_groups(world, b"", |r, g, _| {
                    let mut c = ProcessComm::new(&g, 1, (0..world).collect());
                    assert_eq!((c.rank(), c.world()), (r, world));
                    let out = script(&mut c, seed);
                    end(&g);
                    out
                });
                assert_eq!(got, want, "world {world}, seed {seed}");
            }
        }
    }

    #[test]
    fn subgroups_on_their_own_channels_and_the_blob() {
        // 4 ranks: groups {0,2} and {1,3} on channels 1 and 2 interleaved
        // with the whole world on channel 3; pipeline 0 -> 1 -> 2 on 4.
        let got = on_groups(4, b"nccl-id", |r, g, blob| {
            assert_eq!(blob, b"nccl-id");
            let mut pair = ProcessComm::new(&g, 1 + (r % 2) as u32, vec![r % 2, r % 2 + 2]);
            let mut all = ProcessComm::new(&g, 3, vec![0, 1, 2, 3]);
            let a = pair.all_reduce_scalar(r as f64);
            let b = all.all_reduce_scalar(r as f64 + 0.5);
            let mut buf = CpuBuf::F32(vec![r as f32; 3]);
            pair.all_reduce_sum(&mut buf, 3);
            let mut p = ProcessP2p::new(
                &g,
                4,
                r.checked_sub(1).filter(|_| r <= 2),
                (r < 2).then_some(r + 1),
            );
            let mut got = CpuBuf::F32(vec![-1.0; 2]);
            if r > 0 && r <= 2 {
                p.recv(Peer::Prev, &mut got, 2);
            }
            if r < 2 {
                p.send(Peer::Next, &CpuBuf::F32(vec![10.0 + r as f32; 2]), 2);
            }
            assert_eq!(g.failure(), None);
            end(&g);
            (a, b, buf.as_f32().to_vec(), got.as_f32().to_vec())
        });
        for (r, (a, b, buf, got)) in got.into_iter().enumerate() {
            let partner = (r % 2 + r % 2 + 2) as f64;
            assert_eq!(a, partner);
            assert_eq!(b, 0.5 + 1.5 + 2.5 + 3.5);
            assert_eq!(buf, vec![partner as f32; 3]);
            let want = match r {
                1 | 2 => 10.0 + (r - 1) as f32,
                _ => -1.0,
            };
            assert_eq!(got, vec![want; 2], "rank {r}");
        }
    }

    #[test]
    fn abort_releases_every_rank_with_the_reason() {
        let start = Instant::now();
        let got = on_groups(3, b"", |r, g, _| {
            let mut c = ProcessComm::new(&g, 1, vec![0, 1, 2]);
            if r == 1 {
                std::thread::sleep(Duration::from_millis(50));
                g.abort(3, "rank 1: out of memory");
            } else {
                let mut b = CpuBuf::F32(vec![1.0; 8]);
                c.all_reduce_sum(&mut b, 8);
                // Later calls return at once too.
                c.all_reduce_scalar(1.0);
            }
            let failure = g.failure();
            // The control plane still works: rank 0 hears from everyone.
            let reports = g.gather_to_root(vec![r as u8]);
            let code = g.release(7);
            (failure, reports, code)
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        for (r, (failure, reports, code)) in got.into_iter().enumerate() {
            assert_eq!(
                failure,
                Some((3, "rank 1: out of memory".into())),
                "rank {r}"
            );
            assert_eq!(code, Some(7));
            if r == 0 {
                let reports: Vec<Vec<u8>> =
                    reports.unwrap().into_iter().map(|x| x.unwrap()).collect();
                assert_eq!(reports, vec![vec![0], vec![1], vec![2]]);
            }
        }
    }

    #[test]
    fn a_rank_that_goes_away_fails_the_others() {
        let start = Instant::now();
        let got = on_groups(3, b"", |r, g, _| {
            if r == 2 {
                // Gone without a word: its connections close.
                drop(g);
                return None;
            }
            let mut c = ProcessComm::new(&g, 1, vec![0, 1, 2]);
            let mut b = CpuBuf::F32(vec![1.0; 4]);
            c.all_reduce_sum(&mut b, 4);
            let f = g.failure();
            let reports = g.gather_to_root(Vec::new());
            // As a job ends: rank 1 keeps its connections open until rank 0
            // has heard from everyone, or rank 1 closing them could be the
            // first failure a slow rank 0 notices.
            g.release(0);
            if r == 0 {
                let reports = reports.unwrap();
                assert!(reports[1].is_ok());
                assert!(
                    reports[2].as_ref().unwrap_err().contains("rank 2"),
                    "{reports:?}"
                );
            }
            f
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        for f in got.into_iter().take(2) {
            let (code, why) = f.expect("the group failed");
            assert_eq!(code, EXIT_PEER_LOST);
            assert!(why.contains("rank 2"), "{why}");
        }
    }

    #[test]
    fn a_silent_rank_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let mut l = Some(l);
        let start = Instant::now();
        let got: Vec<Option<Failure>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let listener = if r == 0 { l.take() } else { None };
                    s.spawn(move || {
                        let mut e = env(r, 2, port);
                        e.timeout = Duration::from_millis(400);
                        let (g, _) =
                            ProcessGroup::connect_with(&e, listener, || Ok(Vec::new())).unwrap();
                        if r == 1 {
                            // Alive but stuck: never calls the collective.
                            std::thread::sleep(Duration::from_millis(1500));
                        } else {
                            ProcessComm::new(&g, 1, vec![0, 1]).all_reduce_scalar(1.0);
                        }
                        g.failure()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(10));
        let (code, why) = got[0].clone().expect("rank 0 gave up");
        assert_eq!(code, EXIT_PEER_LOST);
        assert!(
            why.contains("nothing from rank 1") && why.contains(TIMEOUT_ENV),
            "{why}"
        );
        // Rank 1 was told.
        assert_eq!(got[1].as_ref().map(|f| f.0), Some(EXIT_PEER_LOST));
    }

    #[test]
    fn nobody_at_the_master_port_is_a_clear_error() {
        // A port nobody listens on (bound, then closed).
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut e = env(1, 2, port);
        e.timeout = Duration::from_millis(300);
        let start = Instant::now();
        let err = ProcessGroup::connect(&e, || Ok(Vec::new()))
            .err()
            .expect("nobody to reach")
            .to_string();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(
            err.starts_with("MASTER_PORT:")
                && err.contains(&format!("127.0.0.1, MASTER_PORT={port}")),
            "{err}"
        );
    }

    #[test]
    fn rank_0_listens_on_every_interface_when_ranks_are_on_other_hosts() {
        // Every rank on this host, at a loopback MASTER_ADDR: loopback only.
        let l = ProcessGroup::listen(&env(0, 2, 0)).unwrap();
        assert!(l.local_addr().unwrap().ip().is_loopback());
        drop(l);
        // Ranks elsewhere (one of two on this host). Port 0: any free one.
        let l = ProcessGroup::listen(&DistEnv {
            local_world: 1,
            ..env(0, 2, 0)
        })
        .unwrap();
        let at = l.local_addr().unwrap();
        assert!(at.ip().is_unspecified(), "{at}");
        // Reached at an address of this host, not only the one named.
        let port = at.port();
        std::thread::scope(|s| {
            s.spawn(|| TcpStream::connect(("127.0.0.1", port)).unwrap());
            l.set_nonblocking(true).unwrap();
            let deadline = Instant::now() + Duration::from_secs(5);
            assert!(accept_until(&l, deadline).unwrap().is_some());
        });
    }

    #[test]
    fn loopback_ranks_beside_other_hosts_are_refused() {
        let a = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
        let e = env(0, 4, 29500);
        // One host, or several each reached by its address: fine.
        assert_eq!(
            unreachable_ranks(&[None, a("127.0.0.1:4000"), a("127.0.0.1:4001")], &e),
            None
        );
        assert_eq!(
            unreachable_ranks(&[None, a("10.0.0.1:4000"), a("10.0.0.2:4001")], &e),
            None
        );
        // Rank 1 listens on rank 0's loopback, rank 2 is on another host.
        let why = unreachable_ranks(
            &[
                None,
                a("127.0.1.1:4000"),
                a("10.0.0.2:4001"),
                a("10.0.0.2:4002"),
            ],
            &e,
        )
        .expect("refused");
        assert!(
            why.contains("rank 1 reached rank 0 over loopback (127.0.1.1")
                && why.contains("rank 2 joined from another host (10.0.0.2)"),
            "{why}"
        );
    }

    #[test]
    fn missing_ranks_are_named() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut e = env(0, 3, l.local_addr().unwrap().port());
        e.timeout = Duration::from_millis(300);
        let err = ProcessGroup::connect_with(&e, Some(l), || Ok(Vec::new()))
            .err()
            .expect("nobody came")
            .to_string();
        assert!(
            err.contains("only 1 of 3 ranks joined") && err.contains("rank 1, 2"),
            "{err}"
        );
    }

    #[test]
    fn environment() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(
            DistEnv::from_vars(vars(&[("WORLD_SIZE", "1")])).unwrap(),
            None
        );
        let e = DistEnv::from_vars(vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "29500"),
            (TIMEOUT_ENV, "2.5"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                e.rank,
                e.world,
                e.local_rank,
                e.local_world,
                e.master_addr.as_str(),
                e.master_port
            ),
            (2, 4, 0, 4, "node1", 29500)
        );
        assert_eq!(e.timeout, Duration::from_millis(2500));
        // Under torchrun's agent store, MASTER_PORT is the agent's.
        let port_of = |v: &'static [(&'static str, &'static str)]| {
            let e = DistEnv::from_vars(vars(v)).unwrap().unwrap();
            (e.master_port, e.port_var, e.port_source)
        };
        let base: &'static [(&str, &str)] = &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
        ];
        assert_eq!(port_of(base).0, 29500);
        let agent: &'static [(&str, &str)] = &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            (AGENT_STORE_ENV, "True"),
        ];
        let (port, var, source) = port_of(agent);
        assert_eq!((port, var), (29501, "MASTER_PORT"));
        assert!(
            source.contains("torchrun's agent holds MASTER_PORT=29500"),
            "{source}"
        );
        let chosen: &'static [(&str, &str)] = &[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "29500"),
            (AGENT_STORE_ENV, "True"),
            (PORT_ENV, "31000"),
        ];
        assert_eq!(
            port_of(chosen),
            (31000, PORT_ENV, format!("{PORT_ENV}=31000"))
        );
        // A world of one needs no address.
        let one = DistEnv::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
        assert_eq!(one.map(|e| e.world), Some(1));
        let err = |v: &'static [(&'static str, &'static str)]| {
            DistEnv::from_vars(vars(v)).unwrap_err().to_string()
        };
        assert!(err(&[("RANK", "1")]).starts_with("WORLD_SIZE:"));
        assert!(err(&[("WORLD_SIZE", "2")]).starts_with("RANK:"));
        assert!(err(&[("RANK", "x"), ("WORLD_SIZE", "2")]).starts_with("RANK:"));
        assert!(err(&[("RANK", "2"), ("WORLD_SIZE", "2")]).starts_with("RANK:"));
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2")]).starts_with("MASTER_ADDR:"));
        assert!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")])
                .starts_with("MASTER_PORT:")
        );
        assert!(
            err(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "0")
            ])
            .starts_with("MASTER_PORT:")
        );
        assert!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "1"), (TIMEOUT_ENV, "-1")])
                .starts_with(TIMEOUT_ENV)
        );
    }
}
