//! The tokio driver of the failure detector: a monitor that connections feed with heartbeats
//! and that reports each dead node once on a channel. Senders are started per connection with
//! [`crate::Connection::start_heartbeats`].

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::failure::{FailureDetector, HeartbeatConfig, HeartbeatOutcome};

/// Watches nodes by name. Cheap to clone; the detection task stops when the last clone drops.
#[derive(Clone)]
pub struct HeartbeatMonitor {
    state: Arc<State>,
    _ticker: Arc<AbortOnDrop>,
}

impl std::fmt::Debug for HeartbeatMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HeartbeatMonitor(timeout: {:?})", self.state.detector.lock().timeout())
    }
}

struct State {
    detector: Mutex<FailureDetector<String>>,
    wake: Notify,
}

struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl HeartbeatMonitor {
    /// Starts a monitor; dead nodes' names arrive on the returned channel, each once. Must run
    /// inside a tokio runtime.
    pub fn start(config: HeartbeatConfig) -> (HeartbeatMonitor, mpsc::UnboundedReceiver<String>) {
        let state = Arc::new(State {
            detector: Mutex::new(FailureDetector::new(config.timeout)),
            wake: Notify::new(),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let ticker = tokio::spawn(detect(state.clone(), config, tx));
        (HeartbeatMonitor { state, _ticker: Arc::new(AbortOnDrop(ticker)) }, rx)
    }

    /// Starts watching `node` (as if heard from now).
    pub fn watch(&self, node: &str) {
        self.state.detector.lock().watch(node.to_string(), now());
        self.state.wake.notify_one();
    }

    /// Stops watching `node` (it left cleanly).
    pub fn forget(&self, node: &str) {
        self.state.detector.lock().forget(&node.to_string());
    }

    /// Records a heartbeat from `node`.
    pub fn on_heartbeat(&self, node: &str) -> HeartbeatOutcome {
        self.state.detector.lock().on_heartbeat(&node.to_string(), now())
    }

    /// Whether `node` is watched and alive.
    pub fn is_alive(&self, node: &str) -> bool {
        self.state.detector.lock().is_alive(&node.to_string())
    }
}

/// The detector's clock: tokio's, so tests with paused time drive it.
fn now() -> std::time::Instant {
    Instant::now().into_std()
}

async fn detect(state: Arc<State>, config: HeartbeatConfig, tx: mpsc::UnboundedSender<String>) {
    loop {
        let (dead, deadline) = {
            let mut detector = state.detector.lock();
            let dead = detector.poll(now());
            (dead, detector.next_deadline())
        };
        for node in dead {
            tracing::warn!(%node, timeout = ?config.timeout, "node missed its heartbeats: dead");
            if tx.send(node).is_err() {
                return;
            }
        }
        let deadline =
            deadline.map(Instant::from_std).unwrap_or_else(|| Instant::now() + config.timeout);
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {
                // Woken much later than asked: this process did not run meanwhile (SIGSTOP, a
                // stall of the machine), and neither did the connections that read heartbeats.
                // Its own pause must not be read as every peer's death.
                let late = Instant::now().saturating_duration_since(deadline);
                if late > config.interval {
                    tracing::warn!(
                        ?late,
                        "the failure detector ran late (this process stalled): no node is \
                         judged on that time; judgement resumes after one timeout"
                    );
                    state.detector.lock().suspend_judgement(now());
                }
            }
            _ = state.wake.notified() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A monitor whose process stalls for twice the timeout (the runtime's clock jumps with no
    /// task run meanwhile, as after SIGSTOP/SIGCONT) declares nobody dead; a node that stays
    /// silent after the stall is declared dead one timeout later.
    #[tokio::test(start_paused = true)]
    async fn its_own_stall_is_not_read_as_the_nodes_death() {
        let config = HeartbeatConfig {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
        };
        let (monitor, mut dead) = HeartbeatMonitor::start(config);
        monitor.watch("beating");
        monitor.watch("silent");
        tokio::task::yield_now().await;
        // The stall: the clock moves 2 timeouts on while no task (ticker, heartbeat readers)
        // runs; then the queued heartbeat is read.
        tokio::time::advance(config.timeout * 2).await;
        monitor.on_heartbeat("beating");
        tokio::task::yield_now().await;
        assert!(dead.try_recv().is_err(), "a node was declared dead for the monitor's own stall");
        for _ in 0..4 {
            tokio::time::sleep(config.interval).await;
            monitor.on_heartbeat("beating");
        }
        assert!(dead.try_recv().is_err());
        assert_eq!(dead.recv().await.unwrap(), "silent");
        assert!(monitor.is_alive("beating"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_node_is_reported_once_after_the_timeout_and_a_beating_one_never() {
        let config = HeartbeatConfig {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(500),
        };
        let (monitor, mut dead) = HeartbeatMonitor::start(config);
        monitor.watch("quiet");
        monitor.watch("chatty");
        let start = Instant::now();
        for _ in 0..20 {
            tokio::time::sleep(config.interval).await;
            monitor.on_heartbeat("chatty");
        }
        let node = dead.recv().await.unwrap();
        assert_eq!(node, "quiet");
        assert!(Instant::now() - start >= config.timeout);
        assert!(monitor.is_alive("chatty"));
        assert_eq!(monitor.on_heartbeat("quiet"), HeartbeatOutcome::Stale);
        // The chatty node stops: it is reported one timeout after its last heartbeat.
        let last = Instant::now();
        assert_eq!(dead.recv().await.unwrap(), "chatty");
        let waited = Instant::now() - last;
        assert!(
            waited >= config.timeout && waited <= config.timeout + config.interval,
            "{waited:?}"
        );
        assert!(dead.try_recv().is_err());
    }
}
