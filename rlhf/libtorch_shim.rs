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
    let header = nvidia_file("include", |name| name == "cuda_runtime_api.h", "cuda_runtime_api.h");
    let include = header.parent().map(std::path::Path::to_path_buf).unwrap_or_default();
    compile_with(sources, &[], &[include], name);
}

/// Links what a CUDA shim calls besides libtorch's own libraries (which torch-sys links):
/// `libc10_cuda` (streams, guards) and the CUDA runtime of the nvidia-cuda-runtime wheel beside
/// libtorch (`libcudart.so.N`, which has no unversioned name there), with an rpath to it.
#[allow(dead_code)] // Only the engine's build script links CUDA shims.
pub fn link_cuda_runtime() {
    println!("cargo:rustc-link-lib=dylib=c10_cuda");
    let cudart = nvidia_file("lib", |name| name.starts_with("libcudart.so."), "libcudart.so.N");
    if let (Some(dir), Some(name)) = (cudart.parent(), cudart.file_name().and_then(|n| n.to_str()))
    {
        println!("cargo:rustc-link-search=native={}", dir.display());
        println!("cargo:rustc-link-lib=dylib:+verbatim={name}");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
    }
}

/// The first file of the nvidia wheels beside libtorch (`nvidia/*/<dir>/`) whose name passes
/// `wanted`; a build error naming `what` when there is none.
#[allow(dead_code)] // Only the engine's build script builds CUDA shims.
fn nvidia_file(dir: &str, wanted: impl Fn(&str) -> bool, what: &str) -> std::path::PathBuf {
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not say where libtorch is (DEP_TCH_LIBTORCH_LIB)");
    };
    let site =
        std::path::Path::new(&lib_dir).ancestors().nth(2).unwrap_or(std::path::Path::new("/"));
    std::fs::read_dir(site.join("nvidia"))
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|wheel| std::fs::read_dir(wheel.path().join(dir)).into_iter().flatten().flatten())
        .map(|entry| entry.path())
        .find(|path| path.file_name().and_then(|name| name.to_str()).is_some_and(&wanted))
        .unwrap_or_else(|| {
            panic!(
                "the cuda feature needs the CUDA runtime ({what}) under {}/*/{dir}; \
                 scripts/setup-libtorch.sh installs it with the nvidia-cuda-runtime wheel",
                site.join("nvidia").display()
            )
        })
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
