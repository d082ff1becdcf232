//! The TransferDock pipeline with real worker processes: a dock actor and GRPO stage actors
//! (rollout on the tiny model, rule reward, reference and old log-probs, group advantages,
//! training) that talk only through the dock and run concurrently.
//!
//! The checks are on what flowed through the dock: every stage received every row exactly
//! once, in whole groups; the reference and old log-probs (same initial weights, different
//! processes) agree; rewards and advantages match their definitions recomputed here; the
//! training stage stepped once per batch with finite losses and changed its weights.

#[path = "common/grpo.rs"]
mod grpo;

use std::collections::BTreeMap;

use grpo::{AUDIT, GrpoStage, GrpoStageRef};
use rtrun::{ActorOptions, Config, ObjectRef};
use rtrun_rlhf_dock::{
    ColumnValues, DockError, PackedBatch, PipelineSummary, RemoteDock, StageTimeline,
};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

const PROMPTS: usize = 6;
const SAMPLES: usize = 4;
const GROUPS_PER_BATCH: usize = 2;
const MAX_NEW_TOKENS: usize = 6;

fn init() {
    rtrun::init_with(Config { num_cpus: Some(2.0), ..Default::default() }).expect("runtime starts");
}

#[test]
fn grpo_stages_stream_through_the_dock_actor() -> anyhow::Result<()> {
    init();
    let dock = RemoteDock::create(grpo::dock_config(PROMPTS, SAMPLES), ActorOptions::default())?;
    grpo::put_prompts(&dock, PROMPTS, SAMPLES)?;

    // Two DP ranks per stage (one for training): the ranks of a consumer share its rows.
    let specs = grpo::stage_specs(SAMPLES, GROUPS_PER_BATCH, 2);
    let mut actors: Vec<GrpoStageRef> = Vec::new();
    for (index, spec) in specs.iter().enumerate() {
        let role = grpo::role_of(&spec.consumer, SAMPLES, MAX_NEW_TOKENS, 1e-3)?;
        actors.push(GrpoStage::remote(role, 100 + index as u64)?);
    }
    let runs: Vec<ObjectRef<Result<StageTimeline, String>>> =
        actors.iter().zip(&specs).map(|(a, spec)| a.run(dock.clone(), spec.clone())).collect();
    let timelines = rtrun::get_all(&runs)?
        .into_iter()
        .collect::<Result<Vec<StageTimeline>, String>>()
        .map_err(anyhow::Error::msg)?;

    // Every stage received every row exactly once over its ranks, in whole groups.
    let rows = PROMPTS * SAMPLES;
    let mut received: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for timeline in &timelines {
        for span in &timeline.spans {
            assert_eq!(span.rows.len(), SAMPLES * GROUPS_PER_BATCH);
            for group in span.rows.chunks(SAMPLES) {
                assert_eq!(group[0] % SAMPLES, 0, "{}: split group {group:?}", timeline.consumer);
                assert!(group.windows(2).all(|w| w[1] == w[0] + 1), "split group {group:?}");
            }
            received.entry(&timeline.consumer).or_default().extend(&span.rows);
        }
    }
    assert_eq!(received.len(), grpo::STAGES.len());
    for (consumer, mut got) in received {
        got.sort_unstable();
        assert_eq!(got, (0..rows).collect::<Vec<_>>(), "{consumer} rows");
        assert!(dock.all_consumed(consumer)?);
    }

    // Read everything back as the audit consumer and check it against the definitions.
    let columns: Vec<String> =
        ["prompts", "responses", "rm_scores", "ref_log_prob", "old_log_prob", "advantages"]
            .map(String::from)
            .to_vec();
    let batch: PackedBatch =
        dock.get_experience(AUDIT, &columns, rows, None)?.expect("every column is ready");
    let batch = batch.unpack()?;
    let (
        Some(ColumnValues::TokenIds(prompts)),
        Some(ColumnValues::TokenIds(responses)),
        Some(ColumnValues::Scalars(scores)),
        Some(ColumnValues::Floats(reference)),
        Some(ColumnValues::Floats(old)),
        Some(ColumnValues::Floats(advantages)),
    ) = (
        batch.column("prompts"),
        batch.column("responses"),
        batch.column("rm_scores"),
        batch.column("ref_log_prob"),
        batch.column("old_log_prob"),
        batch.column("advantages"),
    )
    else {
        anyhow::bail!("audit batch has the wrong column kinds");
    };
    assert_eq!(batch.rows, (0..rows).collect::<Vec<_>>());
    for row in 0..rows {
        assert_eq!(prompts[row], grpo::prompt(row / SAMPLES));
        let response = &responses[row];
        assert!(!response.is_empty() && response.len() <= MAX_NEW_TOKENS, "row {row}");
        assert!(response.iter().all(|t| (0..384).contains(t)), "row {row}: {response:?}");
        assert!(
            response[..response.len() - 1].iter().all(|t| *t != grpo::EOS),
            "row {row} continues after EOS"
        );
        assert_eq!(scores[row], grpo::rule_reward(response), "row {row} score");
        assert_eq!(reference[row].len(), response.len(), "row {row} ref log-probs");
        assert_eq!(old[row].len(), response.len(), "row {row} old log-probs");
        for (r, o) in reference[row].iter().zip(&old[row]) {
            assert!(*r <= 0.0 && (r - o).abs() < 1e-4, "row {row}: ref {r} vs old {o}");
        }
    }
    for (group, scores) in scores.chunks(SAMPLES).enumerate() {
        let expected = grpo::group_advantages(scores);
        for (i, advantage) in expected.iter().enumerate() {
            let row = group * SAMPLES + i;
            assert_eq!(advantages[row].len(), responses[row].len());
            assert!(advantages[row].iter().all(|a| (a - advantage).abs() < 1e-5), "row {row}");
        }
    }

    // Training stepped once per batch with finite losses, and moved the weights away from the
    // rollout policy's (identical at the start).
    let train = actors.last().expect("the train stage is last");
    let stats = train.train_stats().get()?;
    assert_eq!(stats.losses.len(), PROMPTS / GROUPS_PER_BATCH);
    assert!(stats.losses.iter().all(|l| l.is_finite()), "{stats:?}");
    // The first step sees the weights the old log-probs came from: the ratio is 1.
    assert!((stats.ratios[0] - 1.0).abs() < 1e-4, "{stats:?}");
    let rollout_weights = actors[0].weight_checksum().get()?;
    let trained_weights = train.weight_checksum().get()?;
    assert!(rollout_weights.is_finite() && trained_weights.is_finite());
    assert!((rollout_weights - trained_weights).abs() > 1e-6, "training changed nothing");

    // The summary covers every stage; the timeline is printed for the record (overlap depends
    // on load and is measured by the benchmark, not asserted).
    let summary = PipelineSummary::new(&timelines);
    assert_eq!(summary.stages.len(), grpo::STAGES.len());
    assert!(summary.stages.iter().all(|s| s.rows == rows));
    println!("{}", summary.chart(60));

    // Hostile requests come back as typed errors through the actor.
    let error = dock.get_experience("nobody", &columns, SAMPLES, None).unwrap_err();
    assert!(matches!(
        error,
        rtrun_rlhf_dock::DockCallError::Dock(DockError::UnknownConsumer { .. })
    ));
    let error = dock.get_experience(AUDIT, &columns, 3, None).unwrap_err();
    assert!(matches!(
        error,
        rtrun_rlhf_dock::DockCallError::Dock(DockError::CountNotWholeGroups { .. })
    ));
    dock.clear(None)?;
    assert_eq!(dock.progress()?.ready.iter().map(|(_, n)| n).sum::<usize>(), 0);
    rtrun::shutdown();
    Ok(())
}
