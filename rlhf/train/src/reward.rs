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
        format!("expected one of the reward functions {:?}, found `{name}`", reward_function_names())
    })?;
    Ok(queries.iter().map(|q| (function.score)(&q.prompt, &q.response, &q.label)).collect())
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
}
