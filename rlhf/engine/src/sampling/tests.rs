//! Tests of the sampling maths: exactness of greedy and log-probs, seeded reproducibility, and
//! the empirical distribution against an independently computed truncated softmax.

use super::*;
use crate::rng::{SplitMix64, token_uniform};
use proptest::prelude::*;

const LOGITS: [f32; 8] = [2.0, 1.5, 1.2, 0.5, 0.0, -0.5, -1.0, -3.0];

fn params(temperature: f32, top_k: Option<u32>, top_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, ..SamplingParams::default() }
}

/// The reference: softmax at temperature, keep top-k, keep the nucleus, renormalise. Written
/// independently of the module (full sort, no partial selection).
fn reference_distribution(
    logits: &[f32],
    temperature: f32,
    top_k: Option<u32>,
    top_p: f32,
) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&l| f64::from(l) / f64::from(temperature)).collect();
    let z: f64 = scaled.iter().map(|s| s.exp()).sum();
    let p: Vec<f64> = scaled.iter().map(|s| s.exp() / z).collect();
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap().then(a.cmp(&b)));
    order.truncate(top_k.map_or(p.len(), |k| k as usize));
    let mass: f64 = order.iter().map(|&i| p[i]).sum();
    let mut kept = Vec::new();
    let mut cumulative = 0.0;
    for &i in &order {
        kept.push(i);
        cumulative += p[i] / mass;
        if cumulative >= f64::from(top_p) {
            break;
        }
    }
    let kept_mass: f64 = kept.iter().map(|&i| p[i]).sum();
    let mut out = vec![0.0; p.len()];
    for i in kept {
        out[i] = p[i] / kept_mass;
    }
    out
}

fn empirical(params: &SamplingParams, draws: usize, seed: u64) -> Vec<f64> {
    let mut sampler = Sampler::new();
    let mut rng = SplitMix64::new(seed);
    let mut counts = vec![0usize; LOGITS.len()];
    for _ in 0..draws {
        counts[sampler.sample(&LOGITS, params, rng.next_f64()).unwrap().token as usize] += 1;
    }
    counts.into_iter().map(|c| c as f64 / draws as f64).collect()
}

#[test]
fn empirical_distribution_matches_truncated_softmax() {
    // 200k draws: the standard error of a frequency is at most 0.0011, so 0.006 is > 5 sigma.
    let draws = 200_000;
    for (temperature, top_k, top_p) in [
        (1.0, None, 1.0),
        (0.8, Some(3), 1.0),
        (1.0, None, 0.7),
        (1.3, Some(5), 0.8),
        (0.5, Some(6), 0.95),
    ] {
        let p = params(temperature, top_k, top_p);
        let expected = reference_distribution(&LOGITS, temperature, top_k, top_p);
        let exact = Sampler::new().distribution(&LOGITS, &p).unwrap();
        // The weights are f32 within 2 ulp (2.4e-7 relative), so are the renormalised
        // probabilities within twice that.
        for (e, x) in expected.iter().zip(&exact) {
            assert!(
                (e - x).abs() <= 5e-7 * e,
                "exact distribution {exact:?} vs reference {expected:?}"
            );
        }
        let observed = empirical(&p, draws, 11);
        for (token, (o, e)) in observed.iter().zip(&expected).enumerate() {
            if *e == 0.0 {
                assert_eq!(*o, 0.0, "token {token} is truncated away but was drawn ({p:?})");
            }
            assert!((o - e).abs() < 0.006, "token {token}: observed {o}, expected {e} ({p:?})");
        }
    }
}

#[test]
fn seeded_sampling_reproduces_and_depends_on_seed_and_sample() {
    let p = params(1.0, Some(6), 0.95);
    let run = |seed: u64, sample: u32| -> Vec<u32> {
        let mut sampler = Sampler::new();
        (0..64)
            .map(|pos| sampler.sample(&LOGITS, &p, token_uniform(seed, sample, pos)).unwrap().token)
            .collect()
    };
    assert_eq!(run(5, 0), run(5, 0));
    assert_ne!(run(5, 0), run(6, 0));
    assert_ne!(run(5, 0), run(5, 1));
}

#[test]
fn greedy_takes_the_lowest_argmax_and_returns_the_raw_logprob() {
    let logits = [0.5, 3.0, 3.0, -1.0];
    let got = Sampler::new().sample(&logits, &SamplingParams::greedy(4), 0.99).unwrap();
    assert_eq!(got.token, 1);
    let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
    assert!((f64::from(got.logprob) - (3.0 - z.ln())).abs() < 1e-6);
}

#[test]
fn logprob_modes_return_their_documented_quantities() {
    let (temperature, top_k) = (0.7, Some(2));
    let mut p = params(temperature, top_k, 1.0);
    let z_raw: f64 = LOGITS.iter().map(|&l| f64::from(l).exp()).sum();
    let scaled = |l: f32| f64::from(l) / f64::from(temperature);
    let z_scaled: f64 = LOGITS.iter().map(|&l| scaled(l).exp()).sum();
    let kept = reference_distribution(&LOGITS, temperature, top_k, 1.0);
    for mode in [LogprobMode::Raw, LogprobMode::TemperatureScaled, LogprobMode::Processed] {
        p.logprob_mode = mode;
        let got = Sampler::new().sample(&LOGITS, &p, 0.9).unwrap();
        let l = LOGITS[got.token as usize];
        let expected = match mode {
            LogprobMode::Raw => f64::from(l) - z_raw.ln(),
            LogprobMode::TemperatureScaled => scaled(l) - z_scaled.ln(),
            LogprobMode::Processed => kept[got.token as usize].ln(),
        };
        assert!(
            (f64::from(got.logprob) - expected).abs() < 1e-5,
            "{mode:?}: {} vs {expected}",
            got.logprob
        );
    }
}

#[test]
fn masked_tokens_are_never_sampled_and_hostile_rows_are_errors() {
    let logits = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
    let mut sampler = Sampler::new();
    for u in [0.0, 0.5, 0.999_999] {
        assert_eq!(sampler.sample(&logits, &SamplingParams::default(), u).unwrap().token, 1);
    }
    let p = SamplingParams::default();
    assert_eq!(sampler.sample(&[], &p, 0.5), Err(SamplingError::EmptyLogits));
    assert!(matches!(
        sampler.sample(&[0.0, f32::NAN], &p, 0.5),
        Err(SamplingError::NonFiniteLogit { index: 1, .. })
    ));
    assert!(matches!(
        sampler.sample(&[f32::INFINITY], &p, 0.5),
        Err(SamplingError::NonFiniteLogit { index: 0, .. })
    ));
    assert_eq!(sampler.sample(&[f32::NEG_INFINITY; 2], &p, 0.5), Err(SamplingError::AllMasked(2)));
    assert_eq!(sampler.sample(&[0.0], &p, 1.0), Err(SamplingError::InvalidUniform(1.0)));
}

proptest! {
    #[test]
    fn sampled_token_is_in_the_kept_set_with_a_consistent_logprob(
        logits in prop::collection::vec(-20.0f32..20.0, 1..40),
        temperature in 0.05f32..3.0,
        top_k in prop::option::of(1u32..50),
        top_p in 0.01f32..=1.0,
        uniform in 0.0f64..1.0,
    ) {
        let mut p = params(temperature, top_k, top_p);
        p.logprob_mode = LogprobMode::Processed;
        let mut sampler = Sampler::new();
        let distribution = sampler.distribution(&logits, &p).unwrap();
        let total: f64 = distribution.iter().sum();
        prop_assert!((total - 1.0).abs() < 1e-9);
        let kept = distribution.iter().filter(|&&q| q > 0.0).count();
        prop_assert!(kept >= 1 && kept <= top_k.map_or(logits.len(), |k| k as usize));
        let got = sampler.sample(&logits, &p, uniform).unwrap();
        let q = distribution[got.token as usize];
        prop_assert!(q > 0.0);
        prop_assert!((f64::from(got.logprob) - q.ln()).abs() < 1e-4);
    }
}

proptest! {
    /// Untruncated sampling reuses the kept mass for the log-prob instead of a second pass of
    /// `exp`; the value must be bit for bit the one the second pass gives.
    #[test]
    fn untruncated_logprobs_equal_a_second_pass_bit_for_bit(
        logits in prop::collection::vec(-30.0f32..30.0, 1..300),
        temperature in prop::sample::select(vec![1.0f32, 0.3, 0.7, 1.6]),
        raw in any::<bool>(),
        uniform in 0.0f64..1.0,
    ) {
        let mut p = params(temperature, None, 1.0);
        p.logprob_mode = if raw { LogprobMode::Raw } else { LogprobMode::TemperatureScaled };
        let got = Sampler::new().sample(&logits, &p, uniform).unwrap();
        let max = checked_max(&logits).unwrap();
        let expected = if raw {
            raw_logprob(&logits, max, got.token)
        } else {
            let mut weights = Vec::new();
            fill_weights(&mut weights, &logits, max, temperature);
            let scaled = (f64::from(logits[got.token as usize]) - f64::from(max))
                / f64::from(temperature);
            scaled - sum_weights(&weights).ln()
        };
        prop_assert_eq!(got.logprob.to_bits(), (expected as f32).to_bits());
    }
}

#[test]
fn the_vectorised_exp_is_within_two_ulp_and_zero_below_normal_numbers() {
    let mut worst = 0u32;
    let mut x = 0.0f32;
    while x > -87.3 {
        let exact = f64::from(x).exp() as f32;
        let got = exp_nonpositive(x);
        worst = worst.max(got.to_bits().abs_diff(exact.to_bits()));
        x = x - 1e-4 - x.abs() * 1e-5;
    }
    assert!(worst <= 2, "{worst} ulp");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert_eq!(exp_nonpositive(-88.0), 0.0);
    assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
}

proptest! {
    /// The block-wise inverse CDF picks the token a plain running sum over the row picks, except
    /// where the two sums round differently within a hair of a boundary.
    #[test]
    fn the_blockwise_inverse_cdf_agrees_with_a_running_sum(
        logits in prop::collection::vec(-20.0f32..5.0, 1..2000),
        uniform in 0.0f64..1.0,
    ) {
        let max = checked_max(&logits).unwrap();
        let mut weights = Vec::new();
        fill_weights(&mut weights, &logits, max, 1.0);
        let (total, blocks) = block_sums(&weights);
        prop_assert_eq!(total.to_bits(), sum_weights(&weights).to_bits());
        let target = uniform * total;
        let got = inverse_cdf(&weights, &blocks, target) as usize;
        let before: f64 = weights[..got].iter().map(|&w| f64::from(w)).sum();
        let through = before + f64::from(weights[got]);
        prop_assert!(weights[got] > 0.0);
        prop_assert!(before <= target * (1.0 + 1e-12) && target < through * (1.0 + 1e-12) || got == weights.len() - 1,
            "token {} covers [{}, {}), target {}", got, before, through, target);
    }
}

/// The device sampler (here on CPU tensors) picks the host sampler's token for the same uniform
/// on every row, in every mode (greedy, full, top-k, top-p, both, three log-prob modes), at a
/// 32k vocabulary and a small one, with log-probs equal up to float rounding.
#[test]
fn the_device_sampler_draws_the_host_samplers_tokens() {
    use tch::{Device, Kind, Tensor};
    let mut rng = SplitMix64::new(17);
    for vocab in [37usize, 32_000] {
        let mut all_params = Vec::new();
        for temperature in [0.0, 0.6, 1.0, 1.4] {
            for top_k in [None, Some(1), Some(7), Some(100)] {
                for top_p in [1.0, 0.9, 0.4] {
                    for logprob_mode in
                        [LogprobMode::Raw, LogprobMode::TemperatureScaled, LogprobMode::Processed]
                    {
                        let p = params(temperature, top_k, top_p);
                        all_params.push(SamplingParams { logprob_mode, ..p });
                    }
                }
            }
        }
        let rows = all_params.len();
        // Logits spread over ~12 nats, with ties (rounded to 1/8) so tie-breaking is exercised.
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|_| ((rng.next_f64() * 12.0 - 6.0) * 8.0).round() as f32 / 8.0)
            .collect();
        let uniforms: Vec<f64> = (0..rows).map(|row| token_uniform(5, 0, row)).collect();
        let rows_sampling: Vec<device::RowSampling<'_>> = all_params
            .iter()
            .zip(&uniforms)
            .map(|(params, &uniform)| device::RowSampling { params, uniform })
            .collect();
        let tensor = Tensor::from_slice(&logits).view([rows as i64, vocab as i64]);
        let found = device::sample(&tensor, &rows_sampling).unwrap();
        let mut sampler = Sampler::new();
        for (row, (params, found)) in all_params.iter().zip(&found).enumerate() {
            let expected = sampler
                .sample(&logits[row * vocab..(row + 1) * vocab], params, uniforms[row])
                .unwrap();
            assert_eq!(found.token, expected.token, "vocab {vocab} row {row}: {params:?}");
            let gap = (found.logprob - expected.logprob).abs();
            assert!(gap < 1e-4, "vocab {vocab} row {row}: log-prob {gap} off ({params:?})");
        }
        // A float16 tensor gives the same draws as its float32 values.
        let half = tensor.to_kind(Kind::Half).to_kind(Kind::Float);
        let again = device::sample(&half.to_kind(Kind::Half), &rows_sampling).unwrap();
        assert_eq!(again, device::sample(&half, &rows_sampling).unwrap());
        assert_eq!(tensor.device(), Device::Cpu);
    }
}

/// Many draws from one row through the device sampler follow the distribution the host
/// computes for it (top-k and top-p included), and a bad row or uniform is the host's error.
#[test]
fn device_draws_follow_the_truncated_softmax_and_bad_rows_are_refused() {
    use tch::Tensor;
    let draws = 20_000usize;
    for p in [params(1.0, None, 1.0), params(0.7, Some(5), 1.0), params(1.3, None, 0.8)] {
        let logits: Vec<f32> = LOGITS.iter().copied().cycle().take(draws * LOGITS.len()).collect();
        let tensor = Tensor::from_slice(&logits).view([draws as i64, LOGITS.len() as i64]);
        let uniforms: Vec<f64> = (0..draws).map(|i| token_uniform(11, 2, i)).collect();
        let rows: Vec<device::RowSampling<'_>> =
            uniforms.iter().map(|&uniform| device::RowSampling { params: &p, uniform }).collect();
        let mut counts = [0usize; LOGITS.len()];
        for sampled in device::sample(&tensor, &rows).unwrap() {
            counts[sampled.token as usize] += 1;
        }
        let expected = reference_distribution(&LOGITS, p.temperature, p.top_k, p.top_p);
        for (token, (&count, &probability)) in counts.iter().zip(&expected).enumerate() {
            let frequency = count as f64 / draws as f64;
            // 4.5 standard deviations of a frequency over 20,000 draws, at most ~0.016.
            let bound = 4.5 * (probability * (1.0 - probability) / draws as f64).sqrt() + 1e-9;
            assert!(
                (frequency - probability).abs() <= bound,
                "{p:?} token {token}: {frequency} drawn, {probability} expected"
            );
        }
    }
    let greedy = params(0.0, None, 1.0);
    let warm = params(1.0, None, 1.0);
    for (row, p) in [(vec![1.0, f32::NAN, 0.0], &warm), (vec![f32::INFINITY, 0.0, 1.0], &greedy)] {
        let tensor = Tensor::from_slice(&row).view([1, 3]);
        let rows = [device::RowSampling { params: p, uniform: 0.5 }];
        let error = device::sample(&tensor, &rows).unwrap_err().to_string();
        let expected = checked_max(&row).unwrap_err().to_string();
        assert!(error.contains(&expected), "{error}");
    }
    let tensor = Tensor::from_slice(&[0.0f32, 1.0]).view([1, 2]);
    let rows = [device::RowSampling { params: &warm, uniform: 1.0 }];
    assert!(device::sample(&tensor, &rows).unwrap_err().to_string().contains("uniform"));
}
