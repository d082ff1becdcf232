//! Rule-based and custom reward functions, registered by name at link time, and the remote task
//! that runs them (OpenRLHF runs its custom reward functions as Ray tasks).
//!
//! A function is registered with `linkme` so that worker processes, which are this same binary
//! re-run, find it by name too:
//!
//! ```ignore
//! #[linkme::distributed_slice(rtrun_rlhf::reward::REWARD_FUNCTIONS)]
//! static MY_REWARD: RewardFunction =
//!     RewardFunction { name: "my_reward", score: my_score, needs_label: true };
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A reward function: `(prompt, response, label) -> reward`.
pub type ScoreFn = fn(&str, &str, &str) -> f32;

/// A named reward function.
#[derive(Debug)]
pub struct RewardFunction {
    /// The name configs use (`reward.name`).
    pub name: &'static str,
    /// The function.
    pub score: ScoreFn,
    /// Whether it reads the label (a run on prompt files must then set `data.label_key`).
    pub needs_label: bool,
}

/// Every reward function linked into the binary.
#[linkme::distributed_slice]
pub static REWARD_FUNCTIONS: [RewardFunction];

/// 1 when the response equals the label, else 0.
#[linkme::distributed_slice(REWARD_FUNCTIONS)]
static EXACT_MATCH: RewardFunction =
    RewardFunction { name: "exact_match", score: exact_match, needs_label: true };

/// Partial credit: the fraction of label positions the response gets right, minus a length
/// penalty, and 1 exactly on a perfect answer.
#[linkme::distributed_slice(REWARD_FUNCTIONS)]
static CHAR_MATCH: RewardFunction =
    RewardFunction { name: "char_match", score: char_match, needs_label: true };

/// 1 when the response's final answer equals the label's (GSM8K / MATH style), else 0.
#[linkme::distributed_slice(REWARD_FUNCTIONS)]
static MATH_ANSWER: RewardFunction =
    RewardFunction { name: "math_answer", score: math_answer, needs_label: true };

/// 1 when the response ends in a marked final answer (`#### N` or `\boxed{..}`), else 0.
#[linkme::distributed_slice(REWARD_FUNCTIONS)]
static FORMAT: RewardFunction =
    RewardFunction { name: "format", score: format, needs_label: false };

fn exact_match(_prompt: &str, response: &str, label: &str) -> f32 {
    f32::from(u8::from(response == label))
}

fn char_match(_prompt: &str, response: &str, label: &str) -> f32 {
    if response == label {
        return 1.0;
    }
    let label: Vec<char> = label.chars().collect();
    let response: Vec<char> = response.chars().collect();
    let longest = label.len().max(response.len()).max(1);
    let right = label.iter().zip(&response).filter(|(a, b)| a == b).count();
    // Strictly below 1 unless exact, so an exact answer is always the best in its group.
    0.9 * right as f32 / longest as f32
}

fn math_answer(_prompt: &str, response: &str, label: &str) -> f32 {
    let expected = final_answer(label).and_then(|a| parse_number(&a));
    let given = final_answer(response).and_then(|a| parse_number(&a));
    match (expected, given) {
        (Some(e), Some(g)) => f32::from(u8::from((e - g).abs() <= 1e-6 * e.abs().max(1.0))),
        _ => 0.0,
    }
}

fn format(_prompt: &str, response: &str, _label: &str) -> f32 {
    let marked = marked_answer(response).and_then(|a| parse_number(&a)).is_some();
    f32::from(u8::from(marked))
}

/// The final answer of a solution text: after the last `####`, else the last `\boxed{..}`, else
/// the last number in the text.
pub fn final_answer(text: &str) -> Option<String> {
    marked_answer(text).or_else(|| last_number(text))
}

/// The answer after the last `####` (its first number) or inside the last `\boxed{..}`.
fn marked_answer(text: &str) -> Option<String> {
    if let Some(i) = text.rfind("####") {
        return last_number(text[i + 4..].lines().next().unwrap_or(""));
    }
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (offset, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + offset].trim().to_owned());
                }
            }
            _ => {}
        }
    }
    None
}

/// The last number-like run (`-1,234.5`, `3/4`) in `text`.
fn last_number(text: &str) -> Option<String> {
    let bytes: Vec<char> = text.chars().collect();
    let mut end = bytes.len();
    while end > 0 && !bytes[end - 1].is_ascii_digit() {
        end -= 1;
    }
    if end == 0 {
        return None;
    }
    let mut start = end;
    while start > 0
        && (bytes[start - 1].is_ascii_digit() || matches!(bytes[start - 1], '.' | ',' | '/'))
    {
        start -= 1;
    }
    if start > 0 && bytes[start - 1] == '-' {
        start -= 1;
    }
    Some(
        bytes[start..end].iter().collect::<String>().trim_start_matches([',', '.', '/']).to_owned(),
    )
}

/// A number as answers write it: thousands separators, `$`, a trailing `.` or `%`, simple
/// fractions (`3/4`, `\frac{3}{4}`) and decimals.
pub fn parse_number(text: &str) -> Option<f64> {
    let mut t: String = text
        .trim()
        .trim_start_matches('$')
        .trim_end_matches(['.', '%'])
        .chars()
        .filter(|c| !matches!(c, ',' | ' ' | '$'))
        .collect();
    if let Some(rest) = t.strip_prefix("\\frac{").or_else(|| t.strip_prefix("\\dfrac{")) {
        let (num, den) = rest.trim_end_matches('}').split_once("}{")?;
        t = format!("{num}/{den}");
    }
    if let Some((num, den)) = t.split_once('/') {
        let (num, den) = (num.parse::<f64>().ok()?, den.parse::<f64>().ok()?);
        return (den != 0.0).then(|| num / den);
    }
    t.parse::<f64>().ok().filter(|x| x.is_finite())
}

/// The function registered as `name`.
pub fn find_reward_function(name: &str) -> Option<&'static RewardFunction> {
    REWARD_FUNCTIONS.iter().find(|f| f.name == name)
}

/// Every registered name, sorted.
pub fn reward_function_names() -> Vec<&'static str> {
    let mut names: Vec<&str> = REWARD_FUNCTIONS.iter().map(|f| f.name).collect();
    names.sort_unstable();
    names
}

/// One response to score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardQuery {
    /// The prompt text.
    pub prompt: String,
    /// The decoded response.
    pub response: String,
    /// The dataset label.
    pub label: String,
    /// The record's `data_source` (empty when none).
    #[serde(default)]
    pub data_source: String,
}

/// Scores `queries` with the function registered as `name`, or the one `routes` names for a
/// query's `data_source` (`reward.by_source`); runs as an rtrun task.
#[rtrun::remote]
pub fn score_with_function(
    name: String,
    routes: std::collections::BTreeMap<String, String>,
    queries: Vec<RewardQuery>,
) -> Result<Vec<f32>, String> {
    let find = |name: &str| {
        find_reward_function(name).ok_or_else(|| {
            format!(
                "expected one of the reward functions {:?}, found `{name}`",
                reward_function_names()
            )
        })
    };
    let default = find(&name)?;
    queries
        .iter()
        .map(|q| {
            let function = match routes.get(&q.data_source) {
                Some(routed) => find(routed)?,
                None => default,
            };
            Ok((function.score)(&q.prompt, &q.response, &q.label))
        })
        .collect()
}

/// One batch's rewards and what the reward source said beside them (OpenRLHF's remote reward
/// and `reward_func` may answer a dict with `rewards`, `scores` and `extra_logs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardAnswer {
    /// One reward per query: what the advantages are computed from.
    pub rewards: Vec<f32>,
    /// One score per query, when given: the signal `algo.dynamic_sampling` filters groups on
    /// (OpenRLHF's `scores`; the rewards otherwise).
    #[serde(default)]
    pub scores: Option<Vec<f32>>,
    /// Per-query values to log (OpenRLHF's `extra_logs`): each step's mean becomes the metric
    /// `reward_extra/<name>`.
    #[serde(default)]
    pub extra_logs: std::collections::BTreeMap<String, Vec<f32>>,
}

impl RewardAnswer {
    /// Plain rewards.
    pub fn rewards(rewards: Vec<f32>) -> Self {
        Self { rewards, ..Self::default() }
    }

    /// `answers` of consecutive chunks as one: rewards, scores (when every chunk has them)
    /// and logs in order.
    pub fn concat(answers: Vec<RewardAnswer>) -> Self {
        let all_scored = answers.iter().all(|a| a.scores.is_some());
        let mut out = RewardAnswer::default();
        let mut scores = Vec::new();
        for answer in answers {
            out.rewards.extend(answer.rewards);
            scores.extend(answer.scores.unwrap_or_default());
            for (name, values) in answer.extra_logs {
                out.extra_logs.entry(name).or_default().extend(values);
            }
        }
        out.scores = all_scored.then_some(scores);
        out
    }

    /// Reads `rewards`, and `scores` and `extra_logs` when present, from a JSON answer for
    /// `expected` queries.
    pub fn from_json(value: &serde_json::Value, expected: usize) -> Result<Self, String> {
        let numbers = |key: &str, v: &serde_json::Value| -> Result<Vec<f32>, String> {
            let items = v
                .as_array()
                .ok_or_else(|| format!("expected `{key}` to be an array of numbers, found {v}"))?;
            if items.len() != expected {
                return Err(format!(
                    "expected {expected} values in `{key}`, found {}",
                    items.len()
                ));
            }
            items
                .iter()
                .map(|x| {
                    x.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| format!("expected numbers in `{key}`, found {x}"))
                })
                .collect()
        };
        let rewards = value
            .get("rewards")
            .ok_or_else(|| format!("expected a `rewards` array in the response, found {value}"))?;
        let mut answer = RewardAnswer::rewards(numbers("rewards", rewards)?);
        if let Some(scores) = value.get("scores") {
            answer.scores = Some(numbers("scores", scores)?);
        }
        if let Some(logs) = value.get("extra_logs") {
            let logs = logs
                .as_object()
                .ok_or_else(|| format!("expected `extra_logs` to be an object, found {logs}"))?;
            for (name, values) in logs {
                answer
                    .extra_logs
                    .insert(name.clone(), numbers(&format!("extra_logs.{name}"), values)?);
            }
        }
        Ok(answer)
    }
}

/// How a remote reward task reaches its servers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoteRewardClient {
    /// Reward servers; a task starts at `urls[first % len]` and fails over to the next.
    pub urls: Vec<String>,
    /// Which URL this task tries first (the chunk index: chunks spread over the servers).
    pub first: usize,
    /// Timeout of one request.
    pub timeout: Duration,
    /// Attempts after the first, over the URLs in turn, with doubling back-off from 200 ms.
    pub retries: u32,
}

/// Scores `queries` with a remote reward server (OpenRLHF's `--remote_rm_url`), as an rtrun
/// task: one `POST` of `{"query": [prompt + response], "prompts": [...], "labels": [...]}`
/// expecting `{"rewards": [...]}` with one number per query, and optionally `scores` and
/// `extra_logs` as OpenRLHF's servers send them. `http://` and `https://`.
#[rtrun::remote]
pub fn score_remote(
    client: RemoteRewardClient,
    queries: Vec<RewardQuery>,
) -> Result<RewardAnswer, String> {
    if client.urls.is_empty() {
        return Err("reward.url: expected at least one URL, found none".to_owned());
    }
    let body = serde_json::json!({
        "query": queries.iter().map(|q| format!("{}{}", q.prompt, q.response)).collect::<Vec<_>>(),
        "prompts": queries.iter().map(|q| q.prompt.as_str()).collect::<Vec<_>>(),
        "labels": queries.iter().map(|q| q.label.as_str()).collect::<Vec<_>>(),
    })
    .to_string();
    // One agent for every attempt: it keeps connections to the servers alive between them.
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(client.timeout))
        .http_status_as_error(false)
        .build()
        .into();
    let mut errors = Vec::new();
    let mut pause = Duration::from_millis(200);
    for attempt in 0..=client.retries as usize {
        let url = &client.urls[(client.first + attempt) % client.urls.len()];
        match post_for_rewards(&agent, url, &body, queries.len()) {
            Ok(rewards) => return Ok(rewards),
            // A well-formed answer with the wrong content will not improve on a retry.
            Err(RemoteError::Answer(e)) => return Err(e),
            Err(RemoteError::Transport(e)) => errors.push(e),
        }
        if attempt < client.retries as usize {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }
    Err(format!("remote reward failed after {} attempts: {}", errors.len(), errors.join("; ")))
}

/// Checks that every reward server in `urls` answers (any HTTP status counts: only a server
/// that cannot be reached fails), so a wrong URL is an error when the run starts rather than at
/// its first reward.
pub fn check_reachable(urls: &[String], timeout: Duration) -> Result<(), String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into();
    for url in urls {
        if let Err(e) = agent.get(url).call() {
            return Err(format!("cannot reach the reward server {url}: {e}"));
        }
    }
    Ok(())
}

/// Why a request to a reward server failed.
enum RemoteError {
    /// Could not get an answer (connection, timeout, 5xx): worth another attempt.
    Transport(String),
    /// The server answered something unusable.
    Answer(String),
}

/// Largest response body accepted.
pub const MAX_RESPONSE_BYTES: u64 = 64 << 20;

fn post_for_rewards(
    agent: &ureq::Agent,
    url: &str,
    body: &str,
    expected: usize,
) -> Result<RewardAnswer, RemoteError> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(RemoteError::Answer(format!(
            "expected an http:// or https:// URL, found `{url}`"
        )));
    }
    let mut response = agent
        .post(url)
        .header("Content-Type", "application/json")
        .send(body)
        .map_err(|e| RemoteError::Transport(format!("{url}: {e}")))?;
    let status = response.status().as_u16();
    if status >= 500 || status == 429 {
        return Err(RemoteError::Transport(format!(
            "{url}: expected a 2xx status, found {status}"
        )));
    }
    if !(200..300).contains(&status) {
        return Err(RemoteError::Answer(format!("{url}: expected a 2xx status, found {status}")));
    }
    let text = response
        .body_mut()
        .with_config()
        .limit(MAX_RESPONSE_BYTES)
        .read_to_string()
        .map_err(|e| RemoteError::Transport(format!("{url}: reading the response: {e}")))?;
    let answer = |m: String| RemoteError::Answer(format!("{url}: {m}"));
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| answer(format!("expected a JSON body, found {e}")))?;
    RewardAnswer::from_json(&value, expected).map_err(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_in_rules_score_as_documented() {
        let f = find_reward_function("char_match").unwrap();
        assert_eq!((f.score)("", "1234", "1234"), 1.0);
        assert!(((f.score)("", "1243", "1234") - 0.45).abs() < 1e-6);
        assert!(((f.score)("", "12345", "1234") - 0.72).abs() < 1e-6);
        assert_eq!((f.score)("", "", "1234"), 0.0);
        let e = find_reward_function("exact_match").unwrap();
        assert_eq!((e.score)("", "12", "12"), 1.0);
        assert_eq!((e.score)("", "13", "12"), 0.0);
        assert!(find_reward_function("nope").is_none());
        assert_eq!(
            reward_function_names(),
            vec!["char_match", "exact_match", "format", "math_answer"]
        );
    }

    #[test]
    fn math_answer_reads_gsm8k_boxed_and_last_numbers() {
        let m = find_reward_function("math_answer").unwrap();
        let label = "She has 3 + 4 = 7 apples.\n#### 7";
        assert_eq!((m.score)("", "3 + 4 = 7\n#### 7", label), 1.0);
        assert_eq!((m.score)("", "The answer is \\boxed{7}.", label), 1.0);
        assert_eq!((m.score)("", "so 7 apples", label), 1.0);
        assert_eq!((m.score)("", "3 + 4 = 7 #### 8", label), 0.0);
        assert_eq!((m.score)("", "no idea", label), 0.0);
        assert_eq!((m.score)("", "#### 1,234", "1234"), 1.0);
        assert_eq!((m.score)("", "\\boxed{\\frac{3}{4}}", "#### 0.75"), 1.0);
        assert_eq!((m.score)("", "#### 3/4", "0.75"), 1.0);
        assert_eq!((m.score)("", "It costs $-5.", "#### -5"), 1.0);
        assert_eq!((m.score)("", "#### 7", "no number"), 0.0);
        let f = find_reward_function("format").unwrap();
        assert!(!f.needs_label);
        assert_eq!((f.score)("", "so #### 12", ""), 1.0);
        assert_eq!((f.score)("", "\\boxed{12}", ""), 1.0);
        assert_eq!((f.score)("", "12", ""), 0.0);
        assert_eq!((f.score)("", "#### twelve", ""), 0.0);
        assert_eq!(parse_number("1,000."), Some(1000.0));
        assert_eq!(parse_number("1/0"), None);
    }

    /// Serves each canned raw HTTP response to one connection, in order.
    fn canned_server(responses: Vec<&'static str>) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for (response, stream) in responses.into_iter().zip(listener.incoming()) {
                let mut stream = stream.unwrap();
                let mut buf = [0u8; 4096];
                let _ = stream.read(&mut buf);
                let _ = stream.write_all(response.as_bytes());
            }
        });
        url
    }

    fn query() -> Vec<RewardQuery> {
        vec![RewardQuery {
            prompt: "12>".into(),
            response: "21".into(),
            label: "21".into(),
            data_source: String::new(),
        }]
    }

    #[test]
    fn a_records_data_source_routes_it_to_its_reward_function() {
        // `char_match` gives partial credit, `exact_match` none: "21" against "20".
        let query = |source: &str| RewardQuery {
            prompt: "02>".into(),
            response: "21".into(),
            label: "20".into(),
            data_source: source.into(),
        };
        let routes = [("strict".to_owned(), "exact_match".to_owned())].into();
        let scores = score_with_function(
            "char_match".into(),
            routes,
            vec![query("strict"), query("other"), query("")],
        )
        .unwrap();
        assert_eq!(scores[0], 0.0);
        assert!(scores[1] > 0.0 && scores[1] == scores[2], "{scores:?}");
        let bad = [("strict".to_owned(), "nope".to_owned())].into();
        let err = score_with_function("char_match".into(), bad, vec![query("strict")]);
        assert!(err.unwrap_err().contains("`nope`"));
    }

    fn client(urls: Vec<String>, retries: u32) -> RemoteRewardClient {
        RemoteRewardClient { urls, first: 0, timeout: Duration::from_secs(5), retries }
    }

    #[test]
    fn remote_reward_parses_good_answers_and_rejects_bad_ones() {
        let ok = "HTTP/1.1 200 OK\r\nContent-Length: 18\r\nConnection: close\r\n\r\n{\"rewards\": [0.5]}";
        let client_error = "HTTP/1.1 404 Nope\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let not_json = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello";
        let wrong_count = "HTTP/1.1 200 OK\r\nContent-Length: 21\r\nConnection: close\r\n\r\n{\"rewards\": [0.5, 1]}";
        let no_rewards =
            "HTTP/1.1 200 OK\r\nContent-Length: 17\r\nConnection: close\r\n\r\n{\"scores\": [0.5]}";
        let body = r#"{"rewards": [0.5], "scores": [1], "extra_logs": {"format": [0.25]}}"#;
        let rich = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let rich: &'static str = Box::leak(rich.into_boxed_str());
        let url = canned_server(vec![ok, rich, client_error, not_json, wrong_count, no_rewards]);
        let plain = score_remote(client(vec![url.clone()], 0), query()).unwrap();
        assert_eq!(plain, RewardAnswer::rewards(vec![0.5]));
        // OpenRLHF's full answer: scores and extra logs come through.
        let full = score_remote(client(vec![url.clone()], 0), query()).unwrap();
        assert_eq!(full.scores, Some(vec![1.0]));
        assert_eq!(full.extra_logs["format"], vec![0.25]);
        let errors: Vec<String> = (0..4)
            .map(|_| score_remote(client(vec![url.clone()], 0), query()).unwrap_err())
            .collect();
        assert!(errors[0].contains("found 404"), "{}", errors[0]);
        assert!(errors[1].contains("expected a JSON body"), "{}", errors[1]);
        assert!(errors[2].contains("expected 1 values in `rewards`, found 2"), "{}", errors[2]);
        assert!(errors[3].contains("expected a `rewards` array"), "{}", errors[3]);
        assert!(
            score_remote(client(vec!["ftp://x".into()], 0), query())
                .unwrap_err()
                .contains("https://")
        );
    }

    #[test]
    fn reward_servers_are_checked_for_an_answer_at_start() {
        let not_found = "HTTP/1.1 404 Nope\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let live = canned_server(vec![not_found]);
        check_reachable(std::slice::from_ref(&live), Duration::from_secs(5)).unwrap();
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let dead = format!("http://{closed}/score");
        let err = check_reachable(std::slice::from_ref(&dead), Duration::from_secs(5)).unwrap_err();
        assert!(err.contains(&dead), "{err}");
    }

    #[test]
    fn remote_reward_retries_and_fails_over_to_the_next_url() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let dead = format!("http://{closed}/");
        let busy = "HTTP/1.1 503 Busy\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let ok = "HTTP/1.1 200 OK\r\nContent-Length: 19\r\nConnection: close\r\n\r\n{\"rewards\": [0.25]}";
        let live = canned_server(vec![busy, ok]);
        // dead → live (503) → dead → live (200).
        let rewards = score_remote(client(vec![dead.clone(), live], 3), query()).unwrap();
        assert_eq!(rewards.rewards, vec![0.25]);
        let err = score_remote(client(vec![dead], 1), query()).unwrap_err();
        assert!(err.contains("after 2 attempts"), "{err}");
    }
}
