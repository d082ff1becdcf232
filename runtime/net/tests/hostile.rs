//! Hostile input against live endpoints: a seeded loop of malformed, truncated and oversized
//! frames on authenticated streams, and garbage first frames on uncertified connections. Every
//! stream must end with an error answer or a closed stream within the deadline, nothing may
//! panic, and the endpoint must still serve a valid request afterwards.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use common::*;
use rtrun_net::frame::{Frame, FrameKind, FrameLimits, PRELUDE_LEN, read_frame};
use rtrun_net::protocol::{PullOpen, PullWant, frame};
use rtrun_net::{CLUSTER_SERVER_NAME, HeadCredentials, NetConfig, bootstrap};
use rtrun_object_store::ObjectId;

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
}

/// xorshift64*: a seeded generator, so a failing case can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }

    /// Random bytes of a random length in `min..min + spread`.
    fn noise(&mut self, min: usize, spread: u64) -> Vec<u8> {
        let len = min + self.below(spread) as usize;
        self.bytes(len)
    }
}

/// One hostile stream's bytes, and whether a well-formed answer would be a bug (the input is
/// certainly invalid).
fn hostile_case(rng: &mut Rng, limits: &FrameLimits) -> (Vec<u8>, bool) {
    let valid = Frame::with_parts(
        FrameKind::Request,
        rng.next(),
        Bytes::from(rng.noise(0, 64)),
        vec![Bytes::from(rng.noise(0, 256))],
    )
    .encode();
    match rng.below(9) {
        // Random noise.
        0 => (rng.noise(1, 200), false),
        // A valid request with flipped bytes.
        1 => {
            let mut bytes = valid;
            for _ in 0..=rng.below(4) {
                let at = rng.below(bytes.len() as u64) as usize;
                bytes[at] = rng.next() as u8;
            }
            (bytes, false)
        }
        // Truncated anywhere.
        2 => {
            let cut = 1 + rng.below(valid.len() as u64 - 1) as usize;
            (valid[..cut].to_vec(), true)
        }
        // A part larger than the frame limit (or than memory).
        3 => {
            let mut bytes = valid;
            let huge = if rng.below(2) == 0 { u64::MAX } else { limits.max_frame_size };
            bytes[PRELUDE_LEN..PRELUDE_LEN + 8].copy_from_slice(&huge.to_le_bytes());
            (bytes, true)
        }
        // A head beyond the limit, or too many parts.
        4 => {
            let mut bytes = valid;
            if rng.below(2) == 0 {
                bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
            } else {
                bytes[16..18].copy_from_slice(&u16::MAX.to_le_bytes());
            }
            (bytes, true)
        }
        // A frame kind that cannot open a stream.
        5 => {
            let kinds =
                [FrameKind::Hello, FrameKind::Heartbeat, FrameKind::Response, FrameKind::PullChunk];
            let kind = kinds[rng.below(4) as usize];
            (Frame::new(kind, 1, Bytes::from(rng.bytes(8))).encode(), true)
        }
        // A pull with a garbage head, for a missing object, or with a zero chunk size.
        6 => {
            let bytes = match rng.below(3) {
                0 => Frame::new(FrameKind::PullOpen, 1, Bytes::from(rng.bytes(5))).encode(),
                1 => frame(FrameKind::PullOpen, 1, &PullOpen { object: 999, chunk_size: 64 })
                    .encode(),
                _ => frame(FrameKind::PullOpen, 1, &PullOpen { object: 1, chunk_size: 0 }).encode(),
            };
            (bytes, true)
        }
        // A valid pull open followed by an out-of-range or oversized want.
        7 => {
            let mut bytes =
                frame(FrameKind::PullOpen, 1, &PullOpen { object: 1, chunk_size: 64 }).encode();
            let want = if rng.below(2) == 0 {
                PullWant { chunks: vec![u64::MAX] }
            } else {
                PullWant { chunks: vec![0; 5000] }
            };
            bytes.extend(frame(FrameKind::PullWant, 1, &want).encode());
            (bytes, false)
        }
        // Bad magic or version.
        _ => {
            let mut bytes = valid;
            bytes[rng.below(3) as usize] ^= 0x5a;
            (bytes, true)
        }
    }
}

#[tokio::test]
async fn a_live_endpoint_survives_a_seeded_fuzz_loop_and_still_serves() {
    count_panics();
    let head = HeadCredentials::generate("head").unwrap();
    let source = Arc::new(MemorySource::default());
    source.insert(ObjectId(1), Bytes::from(pattern(1000, 1)));
    let head_ep = Arc::new(head_endpoint(&head, NetConfig::default(), Some(source)));
    let addr = head_ep.local_addr().unwrap();
    spawn_accept_echo(head_ep.clone());
    let node = node_endpoint(issue(&head, "fuzzer"), NetConfig::default(), None);
    let connection = node.connect(addr).await.unwrap();
    let limits = FrameLimits::default();
    let seed = 0x005e_ed0f_f00d_u64;
    let mut rng = Rng(seed);
    let (mut errors, mut closed) = (0, 0);
    for case in 0..300 {
        let (bytes, surely_invalid) = hostile_case(&mut rng, &limits);
        let (mut send, mut recv) = connection.quinn().open_bi().await.unwrap();
        // The server may stop the stream before all bytes are written: that is a refusal too.
        let _ = send.write_all(&bytes).await;
        let _ = send.finish();
        let answer = within(async {
            let mut frames = Vec::new();
            loop {
                match read_frame(&mut recv, &limits).await {
                    Ok(Some(frame)) => frames.push(frame),
                    Ok(None) => break Ok(frames),
                    Err(error) => break Err(error),
                }
            }
        })
        .await;
        match answer {
            Ok(frames) if frames.iter().any(|f| f.kind == FrameKind::Error) => errors += 1,
            Ok(frames) if frames.is_empty() => closed += 1,
            Ok(frames) => assert!(
                !surely_invalid,
                "seed {seed:#x} case {case}: invalid input {:02x?} answered with {:?}",
                &bytes[..bytes.len().min(32)],
                frames.iter().map(|f| f.kind).collect::<Vec<_>>()
            ),
            Err(_) => closed += 1,
        }
    }
    eprintln!("fuzz seed {seed:#x}: {errors} error answers, {closed} closed streams");
    assert!(
        errors > 100,
        "most hostile streams get an error answer ({errors} errors, {closed} closed)"
    );

    // Uncertified connections with garbage first frames are closed; bootstrap still works.
    for _ in 0..10 {
        let client = rtrun_net::tls::bootstrap_client_config(
            *head.node.token.ca_fingerprint(),
            NetConfig::default().transport().unwrap(),
        )
        .unwrap();
        let endpoint = quinn::Endpoint::client(loopback()).unwrap();
        let raw = endpoint.connect_with(client, addr, CLUSTER_SERVER_NAME).unwrap().await.unwrap();
        let (mut send, _recv) = raw.open_bi().await.unwrap();
        let _ = send.write_all(&rng.noise(1, 300)).await;
        let _ = send.finish();
        let reason = within(raw.closed()).await;
        assert!(matches!(reason, quinn::ConnectionError::ApplicationClosed(_)), "{reason}");
    }
    // Certified connections whose first frame is garbage instead of a hello are closed too.
    for _ in 0..10 {
        let client = rtrun_net::tls::client_config(
            &issue(&head, "garbler"),
            NetConfig::default().transport().unwrap(),
        )
        .unwrap();
        let endpoint = quinn::Endpoint::client(loopback()).unwrap();
        let raw = endpoint.connect_with(client, addr, CLUSTER_SERVER_NAME).unwrap().await.unwrap();
        let (mut send, _recv) = raw.open_bi().await.unwrap();
        let _ = send.write_all(&rng.noise(1, 300)).await;
        let _ = send.finish();
        let reason = within(raw.closed()).await;
        assert!(matches!(reason, quinn::ConnectionError::ApplicationClosed(_)), "{reason}");
    }
    bootstrap(addr, &head.node.token, "late-joiner", &NetConfig::default()).await.unwrap();

    // The same connection still serves valid requests and pulls.
    let reply = connection.request(Bytes::from_static(b"still"), vec![]).await.unwrap();
    assert_eq!(&reply.head[..], b"echo:still");
    let pulled = connection.pull_object(ObjectId(1), Default::default()).await.unwrap();
    assert_eq!(pulled, pattern(1000, 1));
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a task panicked on hostile input");
}
