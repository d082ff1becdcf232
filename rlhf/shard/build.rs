//! Build script: gives this crate's test binaries an rpath to libtorch so they run without
//! `LD_LIBRARY_PATH` (`torch-sys`, a direct dependency for this reason, exports its library
//! directory as `DEP_TCH_LIBTORCH_LIB`).

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
}
