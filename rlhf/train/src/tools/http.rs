//! Tools served over HTTP (`tools.url`).
//!
//! The protocol, OpenAI's function-call JSON both ways:
//! - `GET {url}` answers `{"tools": [{"type": "function", "function": {"name", "description",
//!   "parameters"}}, …]}`, read once when the run starts (what the chat template's `tools`
//!   gets);
//! - `POST {url}` with a call, `{"name": "search", "arguments": {…}}`, answers
//!   `{"content": "…"}` (or `{"error": "…"}`).
//!
//! A call that fails (no connection, a timeout of `tools.timeout_s`, a status other than 2xx, a
//! body that is not such JSON or is larger than the limit) answers the model with an error
//! observation; it never fails the step.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::Tool;

/// The tools of one endpoint.
#[derive(Debug)]
pub struct HttpTools {
    url: String,
    agent: ureq::Agent,
    /// Largest answer body read, in bytes.
    max_body_bytes: u64,
}

/// One tool of an endpoint.
struct HttpTool {
    endpoint: Arc<HttpTools>,
    name: String,
    schema: Value,
}

impl HttpTools {
    /// Reads the endpoint's tool list (an error, naming the URL, when it cannot).
    pub fn connect(
        url: &str,
        timeout: Duration,
        max_body_bytes: u64,
    ) -> Result<Vec<Arc<dyn Tool>>, String> {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(format!("expected an http:// or https:// URL, found `{url}`"));
        }
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        let endpoint = Arc::new(HttpTools { url: url.to_owned(), agent, max_body_bytes });
        let listing = endpoint.request(None)?;
        let tools = listing
            .get("tools")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("{url}: expected {{\"tools\": [...]}}, found {listing}"))?;
        tools
            .iter()
            .map(|schema| {
                let name =
                    schema.pointer("/function/name").and_then(Value::as_str).ok_or_else(|| {
                        format!("{url}: expected each tool to have `function.name`, found {schema}")
                    })?;
                let tool: Arc<dyn Tool> = Arc::new(HttpTool {
                    endpoint: Arc::clone(&endpoint),
                    name: name.to_owned(),
                    schema: schema.clone(),
                });
                Ok(tool)
            })
            .collect()
    }

    /// `GET` (no call) or `POST` the call; the answer's JSON.
    fn request(&self, call: Option<&Value>) -> Result<Value, String> {
        let url = &self.url;
        let mut response = match call {
            None => self.agent.get(url).call(),
            Some(call) => self
                .agent
                .post(url)
                .header("Content-Type", "application/json")
                .send(call.to_string()),
        }
        .map_err(|e| format!("{url}: {e}"))?;
        let status = response.status().as_u16();
        if !(200..300).contains(&status) {
            return Err(format!("{url}: expected a 2xx status, found {status}"));
        }
        let text = response
            .body_mut()
            .with_config()
            .limit(self.max_body_bytes)
            .read_to_string()
            .map_err(|e| format!("{url}: reading the answer: {e}"))?;
        serde_json::from_str(&text).map_err(|e| format!("{url}: expected a JSON answer: {e}"))
    }
}

impl Tool for HttpTool {
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn call(&self, arguments: &Value) -> Result<String, String> {
        let call = serde_json::json!({"name": self.name, "arguments": arguments});
        let answer = self.endpoint.request(Some(&call))?;
        if let Some(error) = answer.get("error") {
            return Err(error.as_str().map_or_else(|| error.to_string(), str::to_owned));
        }
        match answer.get("content") {
            Some(Value::String(text)) => Ok(text.clone()),
            Some(other) => Ok(other.to_string()),
            None => Err(format!(
                "{}: expected {{\"content\": ...}} or {{\"error\": ...}}, found {answer}",
                self.endpoint.url
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    use super::*;
    use crate::tools::{ParsedCall, ToolBox, ToolCall};

    /// A one-thread HTTP server answering each request with `answer(method, body)`: `None`
    /// never answers (a hung server).
    fn serve(answer: fn(&str, &str) -> Option<String>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request_line = String::new();
                reader.read_line(&mut request_line).unwrap();
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    if line.trim().is_empty() {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let method = request_line.split(' ').next().unwrap_or("").to_owned();
                let Some(reply) = answer(&method, &String::from_utf8_lossy(&body)) else {
                    std::thread::sleep(Duration::from_secs(5));
                    continue;
                };
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                    reply.len()
                );
            }
        });
        url
    }

    fn echo(method: &str, body: &str) -> Option<String> {
        if method == "GET" {
            return Some(
                r#"{"tools": [{"type": "function", "function": {"name": "echo", "parameters": {}}}]}"#
                    .into(),
            );
        }
        let call: Value = serde_json::from_str(body).unwrap();
        match call["arguments"]["text"].as_str() {
            Some("hang") => None,
            Some("bad") => Some("not json".into()),
            Some("big") => Some(format!("{{\"content\": \"{}\"}}", "x".repeat(10_000))),
            Some("fail") => Some(r#"{"error": "no such page"}"#.into()),
            Some(text) => Some(format!("{{\"content\": \"{text}!\"}}")),
            None => Some(r#"{"content": {"nested": 1}}"#.into()),
        }
    }

    #[test]
    fn an_http_endpoints_tools_answer_and_every_failure_is_an_observation() {
        let url = serve(echo);
        let tools = HttpTools::connect(&url, Duration::from_millis(1500), 4096).unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0].schema()["function"]["name"], "echo");
        let mut toolbox = ToolBox::new(256);
        toolbox.add(tools[0].clone());
        let run = |text: &str| {
            let args = serde_json::json!({"text": text});
            toolbox.run(&ParsedCall::Call(ToolCall { name: "echo".into(), arguments: args }))
        };
        assert_eq!(run("hi").content, "hi!");
        let failed = run("fail");
        assert!(failed.error && failed.content == "error: no such page", "{failed:?}");
        let bad = run("bad");
        assert!(bad.error && bad.content.contains("expected a JSON answer"), "{bad:?}");
        let big = run("big");
        assert!(big.error && big.content.contains("reading the answer"), "{big:?}");
        let nested = toolbox.run(&ParsedCall::Call(ToolCall {
            name: "echo".into(),
            arguments: serde_json::json!({}),
        }));
        assert_eq!(nested.content, r#"{"nested":1}"#);
        // Last: the server then sleeps instead of answering.
        let started = std::time::Instant::now();
        let hung = run("hang");
        assert!(hung.error && started.elapsed() < Duration::from_secs(4), "{hung:?}");
    }

    #[test]
    fn an_endpoint_that_lists_no_tools_or_cannot_be_reached_is_an_error_naming_it() {
        let err = HttpTools::connect("ftp://x", Duration::from_secs(1), 1024).err().unwrap();
        assert!(err.contains("http://"), "{err}");
        let err =
            HttpTools::connect("http://127.0.0.1:9/", Duration::from_secs(1), 1024).err().unwrap();
        assert!(err.contains("127.0.0.1:9"), "{err}");
        let url = serve(|_, _| Some(r#"{"functions": []}"#.into()));
        let err = HttpTools::connect(&url, Duration::from_secs(1), 1024).err().unwrap();
        assert!(err.contains("expected {\"tools\""), "{err}");
    }
}
