//! Tunables of the network layer, each declared once with its default and the reason for it.

use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, MtuDiscoveryConfig, TransportConfig, VarInt};

use crate::error::{NetError, Result};
use crate::failure::HeartbeatConfig;
use crate::frame::FrameLimits;

/// Configuration of an endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct NetConfig {
    /// Limits on frames from authenticated peers. Default: [`FrameLimits::default`] (512 MiB
    /// frames, 1 MiB heads, 64 parts). Hello and bootstrap frames use [`FrameLimits::HANDSHAKE`].
    pub frames: FrameLimits,
    /// Time allowed for the TLS handshake plus the hello or bootstrap exchange. Default 10 s.
    pub handshake_timeout: Duration,
    /// Time allowed to receive one whole request frame once its stream opened. Default 60 s,
    /// enough for a 512 MiB frame on a slow link; a stalled sender loses only its stream.
    pub request_read_timeout: Duration,
    /// A connection silent for this long is closed (QUIC idle timeout). Default 30 s.
    pub idle_timeout: Duration,
    /// The idle timeout of control-plane connections (one end is the cluster head, see
    /// [`crate::Endpoint::connect_control`]). Default 30 s. Longer than `idle_timeout`: a head
    /// that stalls (SIGSTOP, a slow disk, a long pause of its machine) sends nothing meanwhile,
    /// and every node would otherwise drop it, and exit, after `idle_timeout`; the cost is that a
    /// head killed outright is noticed this late by its nodes. QUIC uses the smaller of both
    /// ends' values, so servers advertise the larger of the two timeouts and each client picks.
    pub control_idle_timeout: Duration,
    /// QUIC keep-alive interval, well under the idle timeout. Default 5 s.
    pub keep_alive: Duration,
    /// Concurrent bidirectional streams a peer may open (requests and pulls in flight).
    /// Default 1024.
    pub max_concurrent_streams: u32,
    /// Per-stream flow-control window. Default 32 MiB: a 256 MiB transfer at several GB/s over
    /// a sub-millisecond RTT needs a few MiB in flight; more costs only memory on demand.
    pub stream_receive_window: u64,
    /// Per-connection flow-control window. Default 128 MiB.
    pub connection_receive_window: u64,
    /// Bytes buffered for sending per connection. Default 128 MiB.
    pub send_window: u64,
    /// Largest UDP payload MTU discovery may try. Default 1452 (Ethernet minus IPv6/UDP
    /// headers); raise it on jumbo-frame networks: fewer, larger packets make bulk transfers
    /// cheaper. Capped at [`MAX_BATCH_SAFE_MTU`].
    pub mtu_upper_bound: u16,
    /// UDP payload size used from the first packet with peers on a loopback address, whose
    /// path MTU is known (65536 on Linux `lo`), instead of MTU discovery from 1200 bytes.
    /// Default 6144: 4× fewer packets than 1452 for bulk transfers (a 256 MiB pull measured
    /// 0.2–0.3 GB/s at 1452 and about 1 GB/s at 6144 on the shared build machine). Values are
    /// capped at
    /// [`MAX_BATCH_SAFE_MTU`]: quinn sends up to ten datagrams in one GSO batch, and a batch over
    /// the 65 507-byte UDP limit is dropped by the kernel and resent identically forever (8192
    /// stalled transfers that way). `None` treats loopback like any other path.
    pub loopback_mtu: Option<u16>,
    /// Requested UDP socket send and receive buffer sizes. Default 4 MiB: the kernel default
    /// (~208 KiB) overflows during bulk transfers when the receiver is briefly descheduled, and
    /// every overflow is a loss that halves QUIC's congestion window. The kernel caps the value
    /// at `net.core.rmem_max` / `wmem_max`.
    pub udp_buffer_bytes: usize,
    /// Incoming requests queued per connection before the reader waits for the application.
    /// Default 1024.
    pub request_queue: usize,
    /// Bytes of request parts a peer may have received-but-unanswered on one connection; a
    /// request waits (within `request_read_timeout`) for room before its parts are read.
    /// Default 1 GiB.
    pub max_unanswered_request_bytes: u64,
    /// Most chunk numbers in one pull request. Default 1024.
    pub max_pull_want: usize,
    /// Heartbeat interval and failure-detection timeout.
    pub heartbeat: HeartbeatConfig,
}

impl Default for NetConfig {
    fn default() -> NetConfig {
        NetConfig {
            frames: FrameLimits::default(),
            handshake_timeout: Duration::from_secs(10),
            request_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            control_idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            max_concurrent_streams: 1024,
            stream_receive_window: 32 << 20,
            connection_receive_window: 128 << 20,
            send_window: 128 << 20,
            mtu_upper_bound: 1452,
            loopback_mtu: Some(6144),
            udp_buffer_bytes: 4 << 20,
            request_queue: 1024,
            max_unanswered_request_bytes: 1 << 30,
            max_pull_want: 1024,
            heartbeat: HeartbeatConfig::default(),
        }
    }
}

impl NetConfig {
    /// The QUIC transport parameters for this configuration, as advertised in the handshake:
    /// one bidirectional stream and [`PRE_ADMISSION_RECEIVE_WINDOW`] bytes of credit, so a peer
    /// that has not been admitted (no certificate, wrong token) can make us buffer almost
    /// nothing. `NetConfig::open_admitted` raises both once the hello succeeds.
    pub fn transport(&self) -> Result<Arc<TransportConfig>> {
        self.transport_for(false, self.idle_timeout)
    }

    /// [`NetConfig::transport`] for a peer on a loopback address: a fixed, known MTU.
    pub fn loopback_transport(&self) -> Result<Arc<TransportConfig>> {
        self.transport_for(true, self.idle_timeout)
    }

    /// The transport of a connection with `idle_timeout`, to a loopback peer or not.
    pub(crate) fn transport_for(
        &self,
        loopback: bool,
        idle_timeout: Duration,
    ) -> Result<Arc<TransportConfig>> {
        let bad = |what: &str, value: u64| {
            NetError::Config(format!("{what} of {value} is out of the range QUIC allows"))
        };
        let mut transport = TransportConfig::default();
        transport
            .max_concurrent_bidi_streams(VarInt::from_u32(1))
            .max_concurrent_uni_streams(VarInt::from_u32(0))
            .stream_receive_window(
                VarInt::from_u64(self.stream_receive_window)
                    .map_err(|_| bad("stream_receive_window", self.stream_receive_window))?,
            )
            .receive_window(VarInt::from_u32(PRE_ADMISSION_RECEIVE_WINDOW))
            .send_window(self.send_window)
            .max_idle_timeout(Some(
                IdleTimeout::try_from(idle_timeout)
                    .map_err(|_| bad("idle_timeout (ms)", idle_timeout.as_millis() as u64))?,
            ))
            .keep_alive_interval(Some(self.keep_alive));
        let mut mtu = MtuDiscoveryConfig::default();
        mtu.upper_bound(self.mtu_upper_bound.clamp(1200, MAX_BATCH_SAFE_MTU));
        transport.mtu_discovery_config(Some(mtu));
        if let (true, Some(loopback_mtu)) = (loopback, self.loopback_mtu) {
            let loopback_mtu = loopback_mtu.clamp(1200, MAX_BATCH_SAFE_MTU);
            transport.initial_mtu(loopback_mtu).min_mtu(loopback_mtu).mtu_discovery_config(None);
            // The default initial congestion window (14 720 bytes) would not fit one such
            // packet; start with the same ten packets it allows at 1472 bytes.
            let mut cubic = quinn::congestion::CubicConfig::default();
            cubic.initial_window(10 * u64::from(loopback_mtu));
            transport.congestion_controller_factory(Arc::new(cubic));
        }
        Ok(Arc::new(transport))
    }

    /// Endpoint parameters: accept datagrams up to the MTU discovery bound or the loopback MTU
    /// (receive buffers grow linearly with it).
    pub fn endpoint(&self) -> quinn::EndpointConfig {
        let mut endpoint = quinn::EndpointConfig::default();
        // 1200..=65527 is what QUIC allows; the bound is clamped into it.
        let loopback = self.loopback_mtu.unwrap_or(0).min(MAX_BATCH_SAFE_MTU);
        let largest = self.mtu_upper_bound.min(MAX_BATCH_SAFE_MTU).max(loopback);
        let _ = endpoint.max_udp_payload_size(largest.clamp(1200, MAX_UDP_PAYLOAD));
        endpoint
    }

    /// Grants an admitted peer the configured streams and flow-control credit.
    pub(crate) fn open_admitted(&self, connection: &quinn::Connection) {
        connection.set_max_concurrent_bi_streams(VarInt::from_u32(self.max_concurrent_streams));
        connection.set_max_concurrent_uni_streams(VarInt::from_u32(ADMITTED_UNI_STREAMS));
        let window = VarInt::from_u64(self.connection_receive_window).unwrap_or(VarInt::MAX);
        connection.set_receive_window(window);
    }
}

/// The largest MTU used (discovered or on loopback): ten datagrams, quinn's GSO batch, must
/// fit in one UDP send of at most 65 507 bytes.
pub const MAX_BATCH_SAFE_MTU: u16 = 6500;

/// The largest UDP payload QUIC allows.
const MAX_UDP_PAYLOAD: u16 = 65_527;

/// Connection-level receive credit before admission: room for the hello or bootstrap frame.
pub const PRE_ADMISSION_RECEIVE_WINDOW: u32 = 128 << 10;
/// Unidirectional streams an admitted peer may open (heartbeats use one).
const ADMITTED_UNI_STREAMS: u32 = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_build_and_out_of_range_values_are_named() {
        let config = NetConfig::default();
        assert!(config.transport().is_ok());
        assert!(config.loopback_transport().is_ok());
        assert!(config.heartbeat.timeout <= Duration::from_secs(10));
        let bad = NetConfig { idle_timeout: Duration::MAX, ..NetConfig::default() };
        let err = bad.transport().unwrap_err().to_string();
        assert!(err.contains("idle_timeout"), "{err}");
        let bad = NetConfig { stream_receive_window: u64::MAX, ..NetConfig::default() };
        let err = bad.transport().unwrap_err().to_string();
        assert!(err.contains("stream_receive_window"), "{err}");
    }
}
