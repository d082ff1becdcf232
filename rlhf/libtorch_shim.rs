//! Shared by the build scripts of `rtrun-rlhf-model` and `rtrun-rlhf-engine` (each includes it
//! with `#[path]`): compiles a C++ shim against the libtorch headers next to the library
//! directory torch-sys links, for the parts of libtorch tch does not bind.

/// Compiles `sources` (relative to the crate) with the extra `flags` into the static library
/// `name`.
pub fn compile(sources: &[&str], flags: &[&str], name: &str) {
    compile_with(sources, flags, &[], name);
}

/// [`compile`] for a shim that includes libtorch's CUDA headers: they need the CUDA runtime's
/// headers, which the nvidia-cuda-runtime wheel installs at `nvidia/cu*/include` beside
/// libtorch's `torch` directory.
#[allow(dead_code)] // Only the engine's build script compiles CUDA shims.
pub fn compile_cuda(sources: &[&str], name: &str) {
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let site =
        std::path::Path::new(&lib_dir).ancestors().nth(2).unwrap_or(std::path::Path::new("/"));
    let include = std::fs::read_dir(site.join("nvidia"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("include"))
        .find(|dir| dir.join("cuda_runtime_api.h").is_file())
        .unwrap_or_else(|| {
            panic!(
                "the cuda feature needs the CUDA runtime headers (cuda_runtime_api.h) under {}; \
                 scripts/setup-libtorch.sh installs them with the nvidia-cuda-runtime wheel",
                site.join("nvidia").display()
            )
        });
    compile_with(sources, &[], &[include], name);
}

/// Links what a CUDA shim calls besides libtorch's own libraries (which torch-sys links):
/// `libc10_cuda` (streams, guards) and the CUDA runtime of the nvidia-cuda-runtime wheel beside
/// libtorch (`libcudart.so.N`, which has no unversioned name there), with an rpath to it.
#[allow(dead_code)] // Only the engine's build script links CUDA shims.
pub fn link_cuda_runtime() {
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    println!("cargo:rustc-link-lib=dylib=c10_cuda");
    let site =
        std::path::Path::new(&lib_dir).ancestors().nth(2).unwrap_or(std::path::Path::new("/"));
    let cudart = std::fs::read_dir(site.join("nvidia"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("lib"))
        .flat_map(|dir| std::fs::read_dir(&dir).into_iter().flatten().flatten().map(|e| e.path()))
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libcudart.so."))
        })
        .unwrap_or_else(|| {
            panic!(
                "the cuda feature needs the CUDA runtime (libcudart.so.N) under {}; \
                 scripts/setup-libtorch.sh installs it with the nvidia-cuda-runtime wheel",
                site.join("nvidia").display()
            )
        });
    if let (Some(dir), Some(name)) = (cudart.parent(), cudart.file_name().and_then(|n| n.to_str()))
    {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-lib=dylib:+verbatim={name}");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
}

fn compile_with(sources: &[&str], flags: &[&str], includes: &[std::path::PathBuf], name: &str) {
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
    for include in includes {
        build.include(include);
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
