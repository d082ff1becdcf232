//! Build script: gives this crate's binaries (tests, examples) an rpath to libtorch so they run
//! without `LD_LIBRARY_PATH` (`cargo:rustc-link-arg` does not propagate from `rtrun-rlhf-model`),
//! and compiles the runner's oneDNN shim.

#[path = "../libtorch_shim.rs"]
mod libtorch_shim;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    // oneDNN's packed-weight inner product, which tch does not bind.
    libtorch_shim::compile("src/runner/onednn.cpp", "rtrun_onednn_shim");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
