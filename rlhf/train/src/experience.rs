//! Experience as it travels between the trainer and the role actors, and its tensor layout.
//!
//! Rows are plain vectors (serde) on the wire and become OpenRLHF's layout only inside a role:
//! prompts left-padded to the longest prompt, responses right-padded to the longest response, so
//! the last `R` columns of every row are response positions ([`ResponseBatch`]).

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use rtrun_rlhf_model::ResponseBatch;

use crate::error::{Result, TrainError};
use crate::task::PAD_ID;

/// A prompt and one generated response, as token ids (the response keeps its `<eos>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sequence {
    /// Prompt ids, `<bos>` first.
    pub prompt_ids: Vec<u32>,
    /// Response ids.
    pub response_ids: Vec<u32>,
}

/// One sequence with everything training needs; vectors are per response token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExperienceRow {
    /// The sequence.
    pub sequence: Sequence,
    /// Log-probs of the response under the policy that generated it.
    pub old_log_probs: Vec<f32>,
    /// Log-probs under the reference model (empty when KL is off).
    pub ref_log_probs: Vec<f32>,
    /// Critic values before training (empty without a critic).
    pub values: Vec<f32>,
    /// Advantages.
    pub advantages: Vec<f32>,
    /// Returns (critic targets; empty without a critic).
    pub returns: Vec<f32>,
}

/// Builds the padded batch of `sequences` on `device`.
pub fn response_batch(sequences: &[&Sequence], device: Device) -> Result<ResponseBatch> {
    if sequences.is_empty() {
        return Err(TrainError::Data("a batch needs at least one sequence, found 0".into()));
    }
    let prompt_len = sequences.iter().map(|s| s.prompt_ids.len()).max().unwrap_or(0);
    // At least one response column, so an empty response still gives a well-formed batch
    // (its action mask is all zero).
    let response_len = sequences.iter().map(|s| s.response_ids.len()).max().unwrap_or(0).max(1);
    if prompt_len == 0 {
        return Err(TrainError::Data("every prompt needs at least one token, found none".into()));
    }
    let width = prompt_len + response_len;
    let rows = sequences.len();
    let mut ids = vec![i64::from(PAD_ID); rows * width];
    let mut attention = vec![0i64; rows * width];
    let mut actions = vec![0i64; rows * response_len];
    for (row, s) in sequences.iter().enumerate() {
        let base = row * width;
        let offset = prompt_len - s.prompt_ids.len();
        for (i, &t) in s.prompt_ids.iter().enumerate() {
            ids[base + offset + i] = i64::from(t);
            attention[base + offset + i] = 1;
        }
        for (i, &t) in s.response_ids.iter().enumerate() {
            ids[base + prompt_len + i] = i64::from(t);
            attention[base + prompt_len + i] = 1;
            actions[row * response_len + i] = 1;
        }
    }
    let shape = |w: usize| [rows as i64, w as i64];
    Ok(ResponseBatch {
        input_ids: Tensor::from_slice(&ids).view(shape(width)).to_device(device),
        attention_mask: Tensor::from_slice(&attention).view(shape(width)).to_device(device),
        action_mask: Tensor::from_slice(&actions).view(shape(response_len)).to_device(device),
    })
}

/// A `[rows, R]` tensor of per-response-token values from per-row vectors (right-padded with 0).
pub fn pad_rows(rows: &[&[f32]], width: i64, device: Device) -> Result<Tensor> {
    let width_usize = usize::try_from(width)
        .map_err(|_| TrainError::Data(format!("width should be >= 0, found {width}")))?;
    let mut flat = vec![0f32; rows.len() * width_usize];
    for (r, values) in rows.iter().enumerate() {
        if values.len() > width_usize {
            return Err(TrainError::Data(format!(
                "row {r} should have at most {width} values, found {}",
                values.len()
            )));
        }
        flat[r * width_usize..r * width_usize + values.len()].copy_from_slice(values);
    }
    Ok(Tensor::from_slice(&flat).view([rows.len() as i64, width]).to_device(device))
}

/// Per-row vectors of the first `lengths[r]` entries of a `[rows, R]` tensor.
pub fn unpad_rows(tensor: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<f32>>> {
    let tensor = tensor.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_contiguous()?;
    let size = tensor.size();
    let width = match size.as_slice() {
        [rows, width] if *rows as usize == lengths.len() => *width as usize,
        _ => {
            return Err(TrainError::Data(format!(
                "expected a [{}, R] tensor, found {size:?}",
                lengths.len()
            )));
        }
    };
    let flat = Vec::<f32>::try_from(tensor.f_view([-1])?)?;
    lengths
        .iter()
        .enumerate()
        .map(|(r, &len)| {
            if len > width {
                return Err(TrainError::Data(format!(
                    "row {r} has {len} tokens, wider than {width}"
                )));
            }
            Ok(flat[r * width..r * width + len].to_vec())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_left_pads_prompts_and_right_pads_responses() {
        let a = Sequence { prompt_ids: vec![1, 5, 6], response_ids: vec![7, 2] };
        let b = Sequence { prompt_ids: vec![1, 5], response_ids: vec![8, 9, 2] };
        let batch = response_batch(&[&a, &b], Device::Cpu).unwrap();
        let ids = Vec::<i64>::try_from(batch.input_ids.view([-1])).unwrap();
        assert_eq!(ids, vec![1, 5, 6, 7, 2, 0, 0, 1, 5, 8, 9, 2]);
        let mask = Vec::<i64>::try_from(batch.attention_mask.view([-1])).unwrap();
        assert_eq!(mask, vec![1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1]);
        let actions = Vec::<i64>::try_from(batch.action_mask.view([-1])).unwrap();
        assert_eq!(actions, vec![1, 1, 0, 1, 1, 1]);
        assert_eq!(batch.num_actions().unwrap(), 3);
        let response = Vec::<i64>::try_from(batch.response_ids().unwrap().reshape([-1])).unwrap();
        assert_eq!(response, vec![7, 2, 0, 8, 9, 2]);
    }

    #[test]
    fn pad_and_unpad_round_trip_and_check_shapes() {
        let rows: Vec<Vec<f32>> = vec![vec![1.0, 2.0], vec![3.0]];
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let t = pad_rows(&refs, 3, Device::Cpu).unwrap();
        assert_eq!(unpad_rows(&t, &[2, 1]).unwrap(), rows);
        assert!(pad_rows(&refs, 1, Device::Cpu).is_err());
        assert!(unpad_rows(&t, &[4, 1]).is_err());
        assert!(unpad_rows(&t, &[1]).is_err());
        assert!(response_batch(&[], Device::Cpu).is_err());
    }
}
