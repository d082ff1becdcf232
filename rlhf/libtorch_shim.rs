//! Shared by the build scripts of `rtrun-rlhf-model` and `rtrun-rlhf-engine` (each includes it
//! with `#[path]`): compiles a C++ shim against the libtorch headers next to the library
//! directory torch-sys links, for the parts of libtorch tch does not bind.

/// Compiles `sources` (relative to the crate) with the extra `flags` into the static library
/// `name`.
pub fn compile(sources: &[&str], flags: &[&str], name: &str) {
    for source in sources {
        println!("cargo:rerun-if-changed={source}");
    }
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let root = std::path::Path::new(&lib_dir).parent().unwrap_or(std::path::Path::new("/"));
    let mut build = cc::Build::new();
    for flag in flags {
        build.flag(flag);
    }
    build
        .cpp(true)
        .files(sources)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .opt_level(2)
        .warnings(false)
        .compile(name);
}
