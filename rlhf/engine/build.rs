//! Build script: gives this crate's binaries (tests, examples) an rpath to libtorch so they run
//! without `LD_LIBRARY_PATH` (`cargo:rustc-link-arg` does not propagate from `rtrun-rlhf-model`),
//! and compiles the runner's oneDNN shim.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    build_onednn_shim();
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}

/// Compiles `src/runner/onednn.cpp` (oneDNN's packed-weight inner product, which tch does not
/// bind) against the libtorch headers next to the library directory torch-sys links.
fn build_onednn_shim() {
    println!("cargo:rerun-if-changed=src/runner/onednn.cpp");
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let root = std::path::Path::new(&lib_dir).parent().unwrap_or(std::path::Path::new("/"));
    cc::Build::new()
        .cpp(true)
        .file("src/runner/onednn.cpp")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .opt_level(2)
        .warnings(false)
        .compile("rtrun_onednn_shim");
}
