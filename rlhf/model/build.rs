//! Build script: gives binaries an rpath to libtorch so they run without `LD_LIBRARY_PATH`.
//!
//! `torch-sys` (a direct dependency for exactly this reason) exports its library directory as
//! `DEP_TCH_LIBTORCH_LIB`. With the `cuda` feature the CUDA half of libtorch is linked as well:
//! rustc passes `--as-needed`, which would otherwise drop `libtorch.so` (and `libtorch_cuda.so`
//! behind it) because no symbol of ours refers to them directly.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_cuda_shim();
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}

/// Compiles `src/cuda/shim.cpp` (the CUDA caching allocator's `empty_cache` and statistics)
/// against the libtorch headers next to the library directory torch-sys links.
#[cfg(feature = "cuda")]
fn build_cuda_shim() {
    println!("cargo:rerun-if-changed=src/cuda/shim.cpp");
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let root = std::path::Path::new(&lib_dir).parent().unwrap_or(std::path::Path::new("/"));
    cc::Build::new()
        .cpp(true)
        .file("src/cuda/shim.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(false)
        .compile("rtrun_cuda_shim");
}

#[cfg(not(feature = "cuda"))]
fn build_cuda_shim() {}
