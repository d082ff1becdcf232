//! The dock actor with real worker processes: stage ranks in their own processes stream rows
//! through a `DockActor` concurrently, and typed errors come back across the process boundary.
//!
//! Properties: the ranks of one consumer (different processes calling the actor at once) never
//! receive the same row and together receive every row exactly once; a row's data is the data
//! that was put (never read before it is written); groups stay whole.

use std::collections::BTreeMap;

use rtrun::{ActorOptions, ObjectRef};
use rtrun_rlhf_dock::{
    ColumnKind, ColumnValues, DockCallError, DockConfig, DockError, PackedBatch, PackedColumn,
    PackedNamedColumn, PipelineSummary, RemoteDock, SampleOrder, SamplingConfig, StageSpec,
    StageTimeline, StageWorkError, run_stage,
};

#[ctor::ctor]
fn serve_worker_processes() {
    // Worker processes are this test binary re-run: they serve here and never reach the harness.
    rtrun::run_worker_if_requested();
}

const PROMPTS: usize = 24;
const SAMPLES: usize = 4;

fn response(row: usize) -> Vec<i64> {
    vec![row as i64; 1 + row % 5]
}

/// A stage rank in its own process: measures response lengths (a producer for the next stage)
/// or checks the lengths against the responses (a sink).
struct LengthStage;

#[rtrun::actor]
impl LengthStage {
    pub fn new() -> Self {
        LengthStage
    }

    pub fn run(&self, dock: RemoteDock, spec: StageSpec) -> Result<StageTimeline, String> {
        run_stage(&dock, &spec, |batch| work(&spec, batch)).map_err(|e| e.to_string())
    }
}

fn work(spec: &StageSpec, batch: &PackedBatch) -> Result<Vec<PackedNamedColumn>, StageWorkError> {
    let Some(PackedColumn::TokenIds(responses)) = batch.column("responses") else {
        return Err("expected token-id responses".into());
    };
    for (row, value) in batch.rows.iter().zip(responses.unpack()?) {
        if value != response(*row) {
            return Err(format!("row {row} holds {value:?} before it was written").into());
        }
    }
    if spec.outputs.is_empty() {
        let Some(PackedColumn::Scalars(lengths)) = batch.column("lengths") else {
            return Err("expected scalar lengths".into());
        };
        for (length, actual) in lengths.iter().zip(&responses.lengths) {
            if *length != *actual as f32 {
                return Err(format!("length {length} for a row of {actual}").into());
            }
        }
        return Ok(Vec::new());
    }
    let lengths = responses.lengths.iter().map(|l| *l as f32).collect();
    Ok(vec![PackedNamedColumn::new("lengths", &ColumnValues::Scalars(lengths))])
}

fn config() -> DockConfig {
    DockConfig::new(PROMPTS, SAMPLES)
        .with_column("responses", ColumnKind::TokenIds)
        .with_column("lengths", ColumnKind::Scalars)
        .with_consumer("measure")
        .with_consumer("check")
        .with_sampling(SamplingConfig { order: SampleOrder::Random, seed: 3, ..Default::default() })
}

#[test]
fn ranks_in_processes_share_the_rows_of_a_consumer() -> anyhow::Result<()> {
    rtrun::init()?;
    let dock = RemoteDock::create(config(), ActorOptions::default())?;
    let specs = [
        StageSpec::new("measure", &["responses"], &["lengths"], 2 * SAMPLES).with_rank(0),
        StageSpec::new("measure", &["responses"], &["lengths"], 2 * SAMPLES).with_rank(1),
        StageSpec::new("measure", &["responses"], &["lengths"], 2 * SAMPLES).with_rank(2),
        StageSpec::new("check", &["responses", "lengths"], &[], SAMPLES).with_rank(0),
        StageSpec::new("check", &["responses", "lengths"], &[], SAMPLES).with_rank(1),
    ];
    let stages = specs.iter().map(|_| LengthStage::remote()).collect::<rtrun::Result<Vec<_>>>()?;
    let runs: Vec<ObjectRef<Result<StageTimeline, String>>> =
        stages.iter().zip(&specs).map(|(s, spec)| s.run(dock.clone(), spec.clone())).collect();
    // The producer puts one prompt group at a time while the stages already run.
    for group in 0..PROMPTS {
        let rows: Vec<usize> = (group * SAMPLES..(group + 1) * SAMPLES).collect();
        let values = ColumnValues::TokenIds(rows.iter().map(|r| response(*r)).collect());
        dock.put_experience(PackedBatch {
            rows,
            columns: vec![PackedNamedColumn::new("responses", &values)],
        })?;
    }
    let timelines = rtrun::get_all(&runs)?
        .into_iter()
        .collect::<Result<Vec<_>, String>>()
        .map_err(anyhow::Error::msg)?;
    let mut received: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for timeline in &timelines {
        for span in &timeline.spans {
            for group in span.rows.chunks(SAMPLES) {
                assert!(group[0] % SAMPLES == 0 && group.windows(2).all(|w| w[1] == w[0] + 1));
            }
            received.entry(&timeline.consumer).or_default().extend(&span.rows);
        }
    }
    assert_eq!(received.len(), 2, "both consumers received rows");
    for (consumer, mut rows) in received {
        rows.sort_unstable();
        assert_eq!(rows, (0..PROMPTS * SAMPLES).collect::<Vec<_>>(), "{consumer}");
    }
    let summary = PipelineSummary::new(&timelines);
    assert_eq!(summary.stages.len(), 2);
    let progress = dock.progress()?;
    assert_eq!(progress.rows, PROMPTS * SAMPLES);
    assert!(progress.ready.iter().all(|(_, n)| *n == PROMPTS * SAMPLES), "{progress:?}");
    assert!(progress.consumed.iter().all(|(_, n)| *n == PROMPTS * SAMPLES), "{progress:?}");

    // Errors cross the process boundary typed.
    let columns = vec!["responses".to_owned()];
    assert!(matches!(
        dock.get_experience("measure", &columns, SAMPLES, Some(vec![0, 1])),
        Err(DockCallError::Dock(DockError::RequestMismatch { count: 4, rows: 2 }))
    ));
    let malformed = PackedBatch {
        rows: vec![0],
        columns: vec![PackedNamedColumn {
            name: "responses".into(),
            values: PackedColumn::TokenIds(rtrun_rlhf_dock::PackedRows {
                flat: vec![1],
                lengths: vec![3],
            }),
        }],
    };
    assert!(matches!(
        dock.put_experience(malformed),
        Err(DockCallError::Dock(DockError::MalformedPacked { .. }))
    ));
    let invalid = RemoteDock::create(DockConfig::new(0, 1), ActorOptions::default());
    assert!(matches!(invalid, Err(DockCallError::Runtime(_))), "{invalid:?}");

    // A stage whose work breaks its contract fails its `run` with the reason, in its process.
    let broken = LengthStage::remote()?;
    let spec = StageSpec::new("measure", &["responses"], &["not_a_column"], SAMPLES);
    dock.clear(Some((0..SAMPLES).collect()))?;
    dock.put_experience(PackedBatch {
        rows: (0..SAMPLES).collect(),
        columns: vec![PackedNamedColumn::new(
            "responses",
            &ColumnValues::TokenIds((0..SAMPLES).map(response).collect()),
        )],
    })?;
    let error = broken.run(dock.clone(), spec).get()?.unwrap_err();
    assert_eq!(
        error,
        "stage `measure` declares outputs [not_a_column], its work returned [lengths]"
    );

    // A partial clear resets those rows for every consumer; they can be served again.
    dock.clear(Some((0..SAMPLES).collect()))?;
    assert!(!dock.all_consumed("check")?);
    assert_eq!(dock.get_experience("check", &columns, SAMPLES, None)?, None);
    rtrun::shutdown();
    Ok(())
}
