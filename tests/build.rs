//! Build script: gives the test binaries and examples that link libtorch (the dock pipeline's
//! model stages) an rpath to it, so they and their worker processes run without
//! `LD_LIBRARY_PATH`. `torch-sys` is a direct dependency for exactly this reason: it exports its
//! library directory as `DEP_TCH_LIBTORCH_LIB` only to direct dependents.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
}
