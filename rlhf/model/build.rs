//! Build script: gives binaries an rpath to libtorch so they run without `LD_LIBRARY_PATH`.
//!
//! `torch-sys` (a direct dependency for exactly this reason) exports its library directory as
//! `DEP_TCH_LIBTORCH_LIB`. With the `cuda` feature the CUDA half of libtorch is linked as well:
//! rustc passes `--as-needed`, which would otherwise drop `libtorch.so` (and `libtorch_cuda.so`
//! behind it) because no symbol of ours refers to them directly.

#[path = "../libtorch_shim.rs"]
mod libtorch_shim;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    // Storage release and re-allocation, `.grad` removal and host allocation counting.
    libtorch_shim::compile(&["src/storage/shim.cpp"], &[], "rtrun_storage_shim");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // The caching allocator's empty_cache and statistics.
        #[cfg(feature = "cuda")]
        libtorch_shim::compile(&["src/cuda/shim.cpp"], &[], "rtrun_cuda_shim");
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
