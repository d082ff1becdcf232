//! Build script: gives this crate's binaries (tests, examples) an rpath to libtorch so they run
//! without `LD_LIBRARY_PATH` (`cargo:rustc-link-arg` does not propagate from `rtrun-rlhf-model`),
//! and compiles the runner's C++ kernels.

#[path = "../libtorch_shim.rs"]
mod libtorch_shim;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
        // Where the kernels' OpenMP runtime (below) is found.
        println!("cargo:rustc-link-search=native={lib_dir}");
    }
    // The runner's CPU kernels: the packed-weight projections (its own AVX-512 kernel, and
    // oneDNN's inner product, which tch does not bind), the fused element-wise steps and the
    // attention. The latter spread rows over threads with
    // `at::parallel_for`, which libtorch's headers implement with OpenMP: hence `-fopenmp` and
    // the OpenMP runtime libtorch ships. Multiplies and adds stay unfused so that the kernels'
    // AVX2 and baseline builds agree bit for bit; without trapping maths (the default of no
    // float exceptions trapping, which the code never enables) GCC vectorises their selects.
    println!("cargo:rerun-if-changed=src/runner/shim.h");
    println!("cargo:rerun-if-changed=src/runner/attention_body.h");
    libtorch_shim::compile(
        &[
            "src/runner/onednn.cpp",
            "src/runner/gemm.cpp",
            "src/runner/fused.cpp",
            "src/runner/attention.cpp",
        ],
        &["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"],
        "rtrun_cpu_kernels",
    );
    println!("cargo:rustc-link-lib=dylib:+verbatim=libgomp.so.1");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // The static decode step's CUDA graphs, against the CUDA runtime headers of the
        // nvidia-cuda-runtime wheel installed beside libtorch (scripts/setup-libtorch.sh).
        libtorch_shim::compile_cuda(&["src/runner/graph.cpp"], "rtrun_cuda_graphs");
        libtorch_shim::link_cuda_runtime();
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
