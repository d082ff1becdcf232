//! Rule-based and custom reward functions, registered by name at link time, and the remote task
//! that runs them (OpenRLHF runs its custom reward functions as Ray tasks).
//!
//! A function is registered with `linkme` so that worker processes, which are this same binary
//! re-run, find it by name too:
//!
//! ```ignore
//! #[linkme::distributed_slice(rtrun_rlhf::reward::REWARD_FUNCTIONS)]
//! static MY_REWARD: RewardFunction = RewardFunction { name: "my_reward", score: my_score };
//! ```

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
}

/// Every reward function linked into the binary.
#[linkme::distributed_slice]
pub static REWARD_FUNCTIONS: [RewardFunction];

/// 1 when the response equals the label, else 0.
#[linkme::distributed_slice(REWARD_FUNCTIONS)]
static EXACT_MATCH: RewardFunction = RewardFunction { name: "exact_match", score: exact_match };

/// Partial credit: the fraction of label positions the response gets right, minus a length
/// penalty, and 1 exactly on a perfect answer.
#[linkme::distributed_slice(REWARD_FUNCTIONS)]
static CHAR_MATCH: RewardFunction = RewardFunction { name: "char_match", score: char_match };

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
}

/// Scores `queries` with the function registered as `name` (runs as an rtrun task).
#[rtrun::remote]
pub fn score_with_function(name: String, queries: Vec<RewardQuery>) -> Result<Vec<f32>, String> {
    let function = find_reward_function(&name).ok_or_else(|| {
        format!(
            "expected one of the reward functions {:?}, found `{name}`",
            reward_function_names()
        )
    })?;
    Ok(queries.iter().map(|q| (function.score)(&q.prompt, &q.response, &q.label)).collect())
}

/// Scores `queries` with a remote reward server (OpenRLHF's `--remote_rm_url`), as an rtrun
/// task: one `POST` of `{"query": [prompt + response], "prompts": [...], "labels": [...]}`
/// expecting `{"rewards": [...]}` with one number per query. Plain `http://` only.
#[rtrun::remote]
pub fn score_remote(url: String, queries: Vec<RewardQuery>) -> Result<Vec<f32>, String> {
    let body = serde_json::json!({
        "query": queries.iter().map(|q| format!("{}{}", q.prompt, q.response)).collect::<Vec<_>>(),
        "prompts": queries.iter().map(|q| q.prompt.as_str()).collect::<Vec<_>>(),
        "labels": queries.iter().map(|q| q.label.as_str()).collect::<Vec<_>>(),
    });
    let response = http::post_json(&url, &body.to_string(), std::time::Duration::from_secs(60))?;
    let value: serde_json::Value = serde_json::from_str(&response)
        .map_err(|e| format!("{url}: expected a JSON body, found {e}"))?;
    let rewards = value.get("rewards").and_then(|r| r.as_array()).ok_or_else(|| {
        format!("{url}: expected a `rewards` array in the response, found {value}")
    })?;
    if rewards.len() != queries.len() {
        return Err(format!("{url}: expected {} rewards, found {}", queries.len(), rewards.len()));
    }
    rewards
        .iter()
        .map(|r| {
            r.as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| format!("{url}: expected numbers, found {r}"))
        })
        .collect()
}

/// A minimal HTTP/1.1 client for the remote reward (no TLS, no redirects): enough for a
/// reward server on the cluster's network, with a deadline on every socket operation.
pub mod http {
    use std::io::{Read, Write};
    use std::net::{TcpStream, ToSocketAddrs};
    use std::time::Duration;

    /// Largest response body accepted.
    pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

    /// `POST`s `body` as JSON to `url` and returns the response body of a 2xx answer.
    pub fn post_json(url: &str, body: &str, timeout: Duration) -> Result<String, String> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("expected an http:// URL, found `{url}`"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let address =
            if authority.contains(':') { authority.to_owned() } else { format!("{authority}:80") };
        let socket = address
            .to_socket_addrs()
            .map_err(|e| format!("{url}: cannot resolve `{address}`: {e}"))?
            .next()
            .ok_or_else(|| format!("{url}: `{address}` resolves to nothing"))?;
        let mut stream =
            TcpStream::connect_timeout(&socket, timeout).map_err(|e| format!("{url}: {e}"))?;
        stream.set_read_timeout(Some(timeout)).map_err(|e| format!("{url}: {e}"))?;
        stream.set_write_timeout(Some(timeout)).map_err(|e| format!("{url}: {e}"))?;
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).map_err(|e| format!("{url}: {e}"))?;
        let mut raw = Vec::new();
        stream
            .take(MAX_RESPONSE_BYTES as u64 + 1)
            .read_to_end(&mut raw)
            .map_err(|e| format!("{url}: {e}"))?;
        if raw.len() > MAX_RESPONSE_BYTES {
            return Err(format!("{url}: response larger than {MAX_RESPONSE_BYTES} bytes"));
        }
        let text = String::from_utf8(raw).map_err(|_| format!("{url}: response is not UTF-8"))?;
        let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| {
            format!("{url}: expected an HTTP response, found {} bytes without headers", text.len())
        })?;
        let status: u16 =
            head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| {
                format!(
                    "{url}: expected an HTTP status line, found `{}`",
                    head.lines().next().unwrap_or("")
                )
            })?;
        if !(200..300).contains(&status) {
            return Err(format!("{url}: expected a 2xx status, found {status}"));
        }
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            return Err(format!("{url}: chunked responses are not supported; send Content-Length"));
        }
        Ok(body.to_owned())
    }
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
        assert_eq!(reward_function_names(), vec!["char_match", "exact_match"]);
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
        vec![RewardQuery { prompt: "12>".into(), response: "21".into(), label: "21".into() }]
    }

    #[test]
    fn remote_reward_parses_good_answers_and_rejects_bad_ones() {
        let ok = "HTTP/1.1 200 OK\r\nContent-Length: 17\r\n\r\n{\"rewards\": [0.5]}";
        let server_error = "HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n";
        let not_json = "HTTP/1.1 200 OK\r\n\r\nhello";
        let wrong_count = "HTTP/1.1 200 OK\r\n\r\n{\"rewards\": [0.5, 1]}";
        let no_rewards = "HTTP/1.1 200 OK\r\n\r\n{\"scores\": [0.5]}";
        let garbage = "nonsense";
        let url = canned_server(vec![ok, server_error, not_json, wrong_count, no_rewards, garbage]);
        assert_eq!(score_remote(url.clone(), query()).unwrap(), vec![0.5]);
        let errors: Vec<String> =
            (0..5).map(|_| score_remote(url.clone(), query()).unwrap_err()).collect();
        assert!(errors[0].contains("found 500"), "{}", errors[0]);
        assert!(errors[1].contains("expected a JSON body"), "{}", errors[1]);
        assert!(errors[2].contains("expected 1 rewards, found 2"), "{}", errors[2]);
        assert!(errors[3].contains("expected a `rewards` array"), "{}", errors[3]);
        assert!(errors[4].contains("expected an HTTP response"), "{}", errors[4]);
        assert!(score_remote("https://x".into(), query()).unwrap_err().contains("http://"));
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        assert!(score_remote(format!("http://{closed}/"), query()).is_err());
    }
}
