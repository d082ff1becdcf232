//! How a model splits over the `world` ranks of a tensor-parallel engine (Megatron's split).
//!
//! - Query heads split evenly: rank `r` holds heads `r·Hl .. (r+1)·Hl` with `Hl = H / world`.
//! - Key/value heads follow the query heads that read them. With `G = H / KV` query heads per
//!   key/value head, rank `r`'s heads read the key/value heads `(r·Hl + i) / G`. The rank holds
//!   one key/value head per run of `s = gcd(Hl, G)` of its query heads, so its local grouping
//!   is again uniform (`Hl / s` local key/value heads, `s` queries each). When `KV` divides by
//!   `world` that is `KV / world` distinct heads per rank; when it does not (fewer key/value
//!   heads than ranks, or a grouping that straddles two ranks) some key/value heads are held
//!   by several ranks: they are *replicated*, as vLLM does for `world > KV`.
//! - The MLP's intermediate width splits evenly (gate/up rows, down columns).
//! - Norms, the embedding and the LM head are replicated (see [`crate::tp`] for why).

use rtrun_rlhf_model::ModelConfig;

use crate::error::EngineError;

/// The split of one model over a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpLayout {
    /// Ranks in the group.
    pub world: usize,
    /// Query heads of the whole model.
    pub heads: i64,
    /// Key/value heads of the whole model.
    pub kv_heads: i64,
    /// Width of one head.
    pub head_dim: i64,
    /// MLP intermediate width of the whole model.
    pub intermediate: i64,
}

impl TpLayout {
    /// The layout of `config` over `world` ranks; an error names the numbers that do not divide.
    pub fn new(config: &ModelConfig, world: usize) -> Result<Self, EngineError> {
        let layout = TpLayout {
            world,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            intermediate: config.intermediate_size,
        };
        layout.check()?;
        Ok(layout)
    }

    fn check(&self) -> Result<(), EngineError> {
        let world = self.world as i64;
        if world == 0 {
            return Err(EngineError::InvalidConfig(
                "tensor_parallel_size should be at least 1, found 0".into(),
            ));
        }
        if self.heads % world != 0 {
            return Err(EngineError::InvalidConfig(format!(
                "tensor_parallel_size {world} does not divide the model's {} query heads \
                 (num_attention_heads); use a divisor of {}",
                self.heads, self.heads
            )));
        }
        if self.intermediate % world != 0 {
            return Err(EngineError::InvalidConfig(format!(
                "tensor_parallel_size {world} does not divide the model's intermediate_size {}",
                self.intermediate
            )));
        }
        if self.kv_heads <= 0 || self.heads % self.kv_heads != 0 {
            return Err(EngineError::InvalidConfig(format!(
                "num_attention_heads {} should be a multiple of num_key_value_heads {}",
                self.heads, self.kv_heads
            )));
        }
        Ok(())
    }

    /// Query heads per rank.
    pub fn local_heads(&self) -> i64 {
        self.heads / self.world as i64
    }

    /// Query heads per key/value head in the whole model.
    fn group(&self) -> i64 {
        self.heads / self.kv_heads
    }

    /// Local query heads per local key/value head.
    pub fn local_group(&self) -> i64 {
        gcd(self.local_heads(), self.group())
    }

    /// Key/value heads per rank (some replicated when [`TpLayout::replicates_kv`]).
    pub fn local_kv_heads(&self) -> i64 {
        self.local_heads() / self.local_group()
    }

    /// Whether some key/value head is held by more than one rank.
    pub fn replicates_kv(&self) -> bool {
        self.local_kv_heads() * self.world as i64 > self.kv_heads
    }

    /// The whole model's key/value head of each of `rank`'s local key/value heads, in order.
    pub fn kv_heads_of(&self, rank: usize) -> Vec<i64> {
        let (local, step) = (self.local_heads(), self.local_group());
        (0..self.local_kv_heads())
            .map(|j| (rank as i64 * local + j * step) / self.group())
            .collect()
    }

    /// Intermediate (MLP) width per rank.
    pub fn local_intermediate(&self) -> i64 {
        self.intermediate / self.world as i64
    }

    /// The config of one rank's shard: the same model with its share of the heads and of the
    /// MLP (hidden size, head width, vocabulary and layers unchanged).
    pub fn shard_config(&self, config: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_attention_heads: self.local_heads(),
            num_key_value_heads: self.local_kv_heads(),
            intermediate_size: self.local_intermediate(),
            ..config.clone()
        }
    }
}

fn gcd(a: i64, b: i64) -> i64 {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

#[cfg(test)]
mod tests {
    use rtrun_rlhf_model::ModelFamily;
    use rtrun_rlhf_model::tiny::tiny_config;

    use super::*;

    fn layout(heads: i64, kv_heads: i64, world: usize) -> TpLayout {
        let config = ModelConfig {
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            intermediate_size: 48,
            ..tiny_config(ModelFamily::Llama)
        };
        TpLayout::new(&config, world).unwrap()
    }

    #[test]
    fn kv_heads_split_when_they_divide_and_replicate_when_they_do_not() {
        // 8 query / 4 kv heads over 2 ranks: 2 kv heads each, none shared.
        let even = layout(8, 4, 2);
        assert_eq!((even.kv_heads_of(0), even.kv_heads_of(1)), (vec![0, 1], vec![2, 3]));
        assert!(!even.replicates_kv());
        // 8 query / 2 kv heads over 4 ranks: each kv head on two ranks.
        let replicated = layout(8, 2, 4);
        let held: Vec<_> = (0..4).map(|r| replicated.kv_heads_of(r)).collect();
        assert_eq!(held, vec![vec![0], vec![0], vec![1], vec![1]]);
        assert!(replicated.replicates_kv());
        // 6 query / 3 kv heads over 2 ranks: rank 0 reads kv 0, 0, 1 and rank 1 kv 1, 2, 2,
        // so kv head 1 is on both and each rank holds one head per query head.
        let straddling = layout(6, 3, 2);
        assert_eq!(straddling.kv_heads_of(0), vec![0, 0, 1]);
        assert_eq!(straddling.kv_heads_of(1), vec![1, 2, 2]);
        assert!(straddling.replicates_kv());
    }

    #[test]
    fn every_local_query_head_reads_the_kv_head_it_reads_in_the_whole_model() {
        for (heads, kv_heads) in [(4, 1), (4, 2), (6, 3), (8, 2), (12, 3), (12, 4), (16, 16)] {
            for world in (1..=heads as usize).filter(|w| (heads as usize).is_multiple_of(*w)) {
                let Ok(l) = TpLayout::new(
                    &ModelConfig {
                        num_attention_heads: heads,
                        num_key_value_heads: kv_heads,
                        intermediate_size: 96 * world as i64,
                        ..tiny_config(ModelFamily::Llama)
                    },
                    world,
                ) else {
                    continue;
                };
                for rank in 0..world {
                    let kv = l.kv_heads_of(rank);
                    for i in 0..l.local_heads() {
                        let global_q = rank as i64 * l.local_heads() + i;
                        assert_eq!(
                            kv[(i / l.local_group()) as usize],
                            global_q / (heads / kv_heads)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_size_that_does_not_divide_the_heads_names_both_numbers() {
        let config = ModelConfig {
            num_attention_heads: 6,
            num_key_value_heads: 3,
            ..tiny_config(ModelFamily::Llama)
        };
        let err = TpLayout::new(&config, 4).unwrap_err().to_string();
        assert!(err.contains("tensor_parallel_size 4") && err.contains("6 query heads"), "{err}");
        let err = TpLayout::new(&config, 0).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
    }
}
