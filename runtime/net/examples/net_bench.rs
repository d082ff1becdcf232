//! Loopback benchmark of the network layer, with plain TCP measured in the same run as the
//! anchor: request/response round trips per second with one request in flight, and 256 MiB
//! transfers (as one multipart request and as a chunked pull) in GB/s.
//!
//! `cargo run --release -p rtrun-net --example net_bench -- [seconds] [mtu_upper_bound] [loopback_mtu|off]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use rtrun_net::{
    Endpoint, EndpointOptions, HeadCredentials, NetConfig, NodeCredentials, ObjectSource,
};
use rtrun_object_store::{ObjectId, PullConfig, PullState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SIZE: usize = 256 << 20;

/// Loopback benchmark of the network layer against plain TCP measured in the same run: request
/// round trips per second with one in flight, and 256 MiB transfers (one multipart request and
/// a chunked pull) in GB/s.
#[derive(Parser)]
struct Args {
    /// Length of each round-trip window, in seconds.
    #[arg(default_value_t = 3.0, value_parser = parse_seconds)]
    seconds: f64,
    /// Largest UDP payload MTU discovery may try, in bytes.
    #[arg(default_value_t = NetConfig::default().mtu_upper_bound)]
    mtu_upper_bound: u16,
    /// UDP payload size used from the first packet on loopback, in bytes, or `off` for MTU
    /// discovery as on any other path [default: `NetConfig`'s].
    #[arg(value_name = "LOOPBACK_MTU|off", value_parser = parse_loopback_mtu)]
    loopback_mtu: Option<LoopbackMtu>,
}

/// A `loopback_mtu` argument: a size, or `None` for `off`.
#[derive(Clone, Copy)]
struct LoopbackMtu(Option<u16>);

fn parse_loopback_mtu(value: &str) -> Result<LoopbackMtu, String> {
    match value {
        "off" => Ok(LoopbackMtu(None)),
        bytes => bytes
            .parse()
            .map(|mtu| LoopbackMtu(Some(mtu)))
            .map_err(|e| format!("expected a size in bytes or `off` ({e})")),
    }
}

/// A window length: finite and not negative (a `Duration` can hold nothing else).
fn parse_seconds(value: &str) -> Result<f64, String> {
    let seconds: f64 = value.parse().map_err(|e| format!("expected a number ({e})"))?;
    if seconds.is_finite() && seconds >= 0.0 {
        Ok(seconds)
    } else {
        Err(format!("expected a finite number of seconds, not below 0, found {seconds}"))
    }
}

struct OneObject(Bytes);

impl ObjectSource for OneObject {
    fn size(&self, _: ObjectId) -> Option<u64> {
        Some(self.0.len() as u64)
    }

    fn read(&self, _: ObjectId, offset: u64, len: u64) -> Result<Bytes, String> {
        Ok(self.0.slice(offset as usize..(offset + len) as usize))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let Args { seconds, mtu_upper_bound: mtu, loopback_mtu } = Args::parse();
    let window = Duration::from_secs_f64(seconds);
    let data = Bytes::from((0..SIZE).map(|i| (i % 251) as u8).collect::<Vec<u8>>());

    let loopback_mtu: Option<u16> =
        loopback_mtu.map_or(NetConfig::default().loopback_mtu, |LoopbackMtu(mtu)| mtu);
    let config = NetConfig { mtu_upper_bound: mtu, loopback_mtu, ..NetConfig::default() };
    let head = HeadCredentials::generate("head")?;
    let (cert, key) = head.authority.issue_node("node")?;
    let node = NodeCredentials {
        ca_cert: head.node.ca_cert.clone(),
        cert,
        key,
        token: head.node.token.clone(),
    };
    let server = Arc::new(Endpoint::bind(
        "127.0.0.1:0".parse()?,
        head.node.clone(),
        EndpointOptions {
            config: config.clone(),
            authority: Some(head.authority.clone()),
            object_source: Some(Arc::new(OneObject(data.clone()))),
            monitor: None,
        },
    )?);
    let addr = server.local_addr()?;
    let accepting = server.clone();
    tokio::spawn(async move {
        while let Some(connection) = accepting.accept().await {
            tokio::spawn(async move {
                while let Some(request) = connection.next_request().await {
                    // Small answers: the benchmark measures one direction at a time.
                    let head = request.frame.head.clone();
                    let _ = request.respond(head, Vec::new()).await;
                }
            });
        }
    });
    let client = Endpoint::bind(
        "127.0.0.1:0".parse()?,
        node,
        EndpointOptions { config, ..Default::default() },
    )?;
    let connection = client.connect(addr).await?;

    // Round trips, one in flight.
    let ping = Bytes::from_static(b"ping0000");
    for _ in 0..200 {
        connection.request(ping.clone(), Vec::new()).await?;
    }
    let start = Instant::now();
    let mut count = 0u64;
    while start.elapsed() < window {
        connection.request(ping.clone(), Vec::new()).await?;
        count += 1;
    }
    let quic_rps = count as f64 / start.elapsed().as_secs_f64();
    let tcp_rps = tcp_round_trips(window).await?;

    // 256 MiB as one multipart request (client to server), best of 3.
    let mut multipart = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        connection.request(Bytes::from_static(b"blob"), vec![data.clone()]).await?;
        multipart = multipart.min(start.elapsed().as_secs_f64());
    }
    // 256 MiB as a chunked pull (server to client) straight into a destination that is already
    // mapped, as an object-store allocation is; best of 3.
    let mut pull = f64::MAX;
    let mut destination = vec![1u8; SIZE];
    for _ in 0..3 {
        let start = Instant::now();
        let config = PullConfig::default();
        let mut stream = connection.open_pull(ObjectId(1), config.chunk_size).await?;
        let mut state = PullState::new(ObjectId(1), stream.size(), config)?;
        stream.run(&mut state, &mut destination).await?;
        pull = pull.min(start.elapsed().as_secs_f64());
        anyhow::ensure!(destination[..] == data[..], "pull corrupted");
    }
    let path = connection.quinn().stats().path;
    let tcp = tcp_transfer(&data).await?;
    let gb = SIZE as f64 / 1e9;
    println!(
        "rtrun-net loopback benchmark (mtu_upper_bound {mtu}, loopback_mtu {loopback_mtu:?}, {seconds} s windows)"
    );
    println!(
        "round trips, 1 in flight: QUIC {quic_rps:>9.0}/s   TCP anchor {tcp_rps:>9.0}/s   ratio {:.2}",
        quic_rps / tcp_rps
    );
    println!("256 MiB multipart request: {:>6.2} GB/s ({:.0} ms)", gb / multipart, multipart * 1e3);
    println!("256 MiB chunked pull:      {:>6.2} GB/s ({:.0} ms)", gb / pull, pull * 1e3);
    println!("256 MiB plain TCP anchor:  {:>6.2} GB/s ({:.0} ms)", gb / tcp, tcp * 1e3);
    println!(
        "QUIC path: mtu {} bytes, rtt {:?}, {} congestion events, {} lost packets",
        path.current_mtu, path.rtt, path.congestion_events, path.lost_packets
    );
    Ok(())
}

/// Ping-pong of 8-byte messages over loopback TCP (no TLS): the floor any transport pays.
async fn tcp_round_trips(window: Duration) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Ok((mut socket, _)) = listener.accept().await {
            let _ = socket.set_nodelay(true);
            let mut buffer = [0u8; 8];
            while socket.read_exact(&mut buffer).await.is_ok() {
                if socket.write_all(&buffer).await.is_err() {
                    break;
                }
            }
        }
    });
    let mut socket = TcpStream::connect(addr).await?;
    socket.set_nodelay(true)?;
    let mut buffer = [0u8; 8];
    let start = Instant::now();
    let mut count = 0u64;
    while start.elapsed() < window {
        socket.write_all(b"ping0000").await?;
        socket.read_exact(&mut buffer).await?;
        count += 1;
    }
    Ok(count as f64 / start.elapsed().as_secs_f64())
}

/// Best of 3 seconds to send `data` over loopback TCP into a pre-sized buffer.
async fn tcp_transfer(data: &Bytes) -> anyhow::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let len = data.len();
    let receiver = tokio::spawn(async move {
        let mut times = Vec::new();
        let mut buffer = vec![0u8; len];
        for _ in 0..3 {
            let (mut socket, _) = listener.accept().await?;
            let start = Instant::now();
            socket.read_exact(&mut buffer).await?;
            socket.write_all(b"k").await?;
            times.push(start.elapsed().as_secs_f64());
        }
        anyhow::Ok(times)
    });
    let mut best = f64::MAX;
    for _ in 0..3 {
        let mut socket = TcpStream::connect(addr).await?;
        let start = Instant::now();
        socket.write_all(data).await?;
        let mut ack = [0u8; 1];
        socket.read_exact(&mut ack).await?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    receiver.await??;
    Ok(best)
}
