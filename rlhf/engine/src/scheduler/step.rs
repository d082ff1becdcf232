//! One scheduling step: running sequences first (with preemption by recompute when blocks run
//! out), then FCFS admission of waiting sequences.

use super::{
    ChunkKind, ScheduledChunk, Scheduler, SchedulerError, SchedulerOutput, SequenceStatus,
};
use crate::SequenceId;

impl Scheduler {
    /// Decides what the next step runs. See the module documentation for the policy.
    pub fn schedule(&mut self) -> Result<SchedulerOutput, SchedulerError> {
        let mut output = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        self.schedule_running(&mut output, &mut budget)?;
        if output.preempted.is_empty() {
            self.admit_waiting(&mut output, &mut budget)?;
        }
        if !output.chunks.is_empty() {
            self.steps += 1;
        }
        Ok(output)
    }

    fn schedule_running(
        &mut self,
        output: &mut SchedulerOutput,
        budget: &mut usize,
    ) -> Result<(), SchedulerError> {
        let mut index = 0;
        while index < self.running.len() && *budget > 0 {
            let id = self.running[index];
            let seq = self.sequences.get(&id).ok_or(SchedulerError::UnknownSequence(id))?;
            if seq.awaiting_token {
                index += 1;
                continue;
            }
            let start = seq.num_computed;
            let num_tokens = (seq.tokens.len() - start).min(*budget);
            let slots = self.blocks.num_slots(id).ok_or(SchedulerError::UnknownSequence(id))?;
            let new_slots = (start + num_tokens).saturating_sub(slots);
            let mut preempted_self = false;
            while self.blocks.blocks_needed_to_append(id, new_slots)?
                > self.blocks.num_free_blocks()
            {
                // Invariant: `id` itself is in `running`, so the list is not empty.
                let victim =
                    self.running.pop().expect("running holds the sequence being scheduled");
                self.preempt(victim)?;
                output.preempted.push(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            self.blocks.append_slots(id, new_slots)?;
            self.push_chunk(output, id, start, num_tokens)?;
            *budget -= num_tokens;
            index += 1;
        }
        Ok(())
    }

    fn admit_waiting(
        &mut self,
        output: &mut SchedulerOutput,
        budget: &mut usize,
    ) -> Result<(), SchedulerError> {
        while let Some(&id) = self.waiting.front() {
            if *budget == 0 || self.running.len() >= self.config.max_num_seqs {
                break;
            }
            let seq = self.sequences.get(&id).ok_or(SchedulerError::UnknownSequence(id))?;
            let needed = self.blocks.blocks_needed_to_allocate(&seq.tokens);
            if needed + self.watermark_blocks > self.blocks.num_free_blocks() {
                break;
            }
            self.waiting.pop_front();
            let cached = self.blocks.allocate(id, &seq.tokens)?;
            let num_tokens = (seq.tokens.len() - cached).min(*budget);
            self.cached_prompt_tokens += cached as u64;
            self.admissions += 1;
            let seq = self.sequences.get_mut(&id).ok_or(SchedulerError::UnknownSequence(id))?;
            seq.num_computed = cached;
            seq.status = SequenceStatus::Running;
            seq.admitted_at = self.admissions;
            self.running.push(id);
            self.push_chunk(output, id, cached, num_tokens)?;
            *budget -= num_tokens;
        }
        Ok(())
    }

    /// Records that positions `start..start + num_tokens` of `id` run in this step, registers
    /// the blocks they complete in the prefix cache, and flags the sequence for a token when
    /// the chunk reaches its end.
    fn push_chunk(
        &mut self,
        output: &mut SchedulerOutput,
        id: SequenceId,
        start: usize,
        num_tokens: usize,
    ) -> Result<(), SchedulerError> {
        let seq = self.sequences.get_mut(&id).ok_or(SchedulerError::UnknownSequence(id))?;
        seq.num_computed = start + num_tokens;
        let sample = seq.num_computed == seq.tokens.len();
        seq.awaiting_token = sample;
        let kind = if num_tokens == 1 && start + 1 == seq.tokens.len() && start >= seq.prompt_len {
            ChunkKind::Decode
        } else {
            self.prefill_tokens += num_tokens as u64;
            ChunkKind::Prefill
        };
        self.blocks.cache_full_blocks(id, &seq.tokens, seq.num_computed)?;
        output.chunks.push(ScheduledChunk { sequence: id, kind, start, num_tokens, sample });
        output.num_batched_tokens += num_tokens;
        Ok(())
    }

    /// Preemption by recompute: drop the K/V, keep the tokens, wait at the front of the queue.
    fn preempt(&mut self, id: SequenceId) -> Result<(), SchedulerError> {
        self.blocks.free(id)?;
        let seq = self.sequences.get_mut(&id).ok_or(SchedulerError::UnknownSequence(id))?;
        seq.num_computed = 0;
        seq.status = SequenceStatus::Waiting;
        seq.awaiting_token = false;
        seq.num_preemptions += 1;
        self.preemptions += 1;
        self.waiting.push_front(id);
        Ok(())
    }
}
