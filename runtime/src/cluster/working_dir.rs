//! A job's working directory (`rtrun submit --working-dir DIR`), as Ray's `working_dir`:
//! packed on the submitting machine into a deterministic tar (entries sorted, times and owners
//! zeroed, modes kept), named by its SHA-256 and uploaded to the head once (the content-addressed
//! cache that holds job binaries), then unpacked for each job on the node that runs its driver,
//! which starts there. A second submission of the same files uploads nothing.
//!
//! Uncompressed on purpose: the package crosses a cluster's own network once and is cached; the
//! files that are large in RLHF (checkpoints, datasets) belong on paths every node can read, and
//! the size limit says so.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The largest package accepted: what one control frame carries (512 MiB), less room for its
/// head. Ray's limit for `working_dir` is of the same order (500 MiB).
pub const MAX_PACKAGE_BYTES: u64 = 500 << 20;

/// Packs `dir` (its contents, relative paths) into a deterministic tar.
pub fn pack(dir: &Path) -> Result<Vec<u8>> {
    let metadata = std::fs::metadata(dir).map_err(|e| {
        Error::Invalid(format!("--working-dir {}: cannot read it: {e}", dir.display()))
    })?;
    if !metadata.is_dir() {
        return Err(Error::Invalid(format!("--working-dir {}: not a directory", dir.display())));
    }
    let mut entries = Vec::new();
    walk(dir, Path::new(""), &mut entries)?;
    let total: u64 = entries.iter().map(|e| e.size).sum();
    if total > MAX_PACKAGE_BYTES {
        return Err(Error::Invalid(format!(
            "--working-dir {}: {} MiB of files, more than the {} MiB a job may carry; put large \
             files (checkpoints, datasets) on a path every node can read and pass that path",
            dir.display(),
            total >> 20,
            MAX_PACKAGE_BYTES >> 20
        )));
    }
    let mut builder = tar::Builder::new(Vec::with_capacity(total as usize + (1 << 16)));
    builder.mode(tar::HeaderMode::Deterministic);
    builder.follow_symlinks(false);
    for entry in &entries {
        let path = dir.join(&entry.relative);
        builder.append_path_with_name(&path, &entry.relative).map_err(|e| {
            Error::Invalid(format!("--working-dir: cannot pack {}: {e}", path.display()))
        })?;
    }
    builder
        .into_inner()
        .map_err(|e| Error::System(format!("--working-dir {}: packing: {e}", dir.display())))
}

/// One file, directory or symbolic link of a working directory.
struct Entry {
    relative: PathBuf,
    size: u64,
}

/// Collects the entries under `root/relative` in sorted order (directories before their
/// contents), refusing what a tar cannot carry faithfully (sockets, devices, FIFOs).
fn walk(root: &Path, relative: &Path, entries: &mut Vec<Entry>) -> Result<()> {
    let dir = root.join(relative);
    let read = |e: std::io::Error| {
        Error::Invalid(format!("--working-dir: cannot read {}: {e}", dir.display()))
    };
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .map_err(read)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<std::io::Result<_>>()
        .map_err(read)?;
    names.sort();
    for name in names {
        let relative = relative.join(&name);
        let path = root.join(&relative);
        let metadata = std::fs::symlink_metadata(&path).map_err(|e| {
            Error::Invalid(format!("--working-dir: cannot read {}: {e}", path.display()))
        })?;
        let kind = metadata.file_type();
        if kind.is_dir() {
            entries.push(Entry { relative: relative.clone(), size: 0 });
            walk(root, &relative, entries)?;
        } else if kind.is_file() || kind.is_symlink() {
            entries.push(Entry { relative, size: metadata.len() });
        } else {
            return Err(Error::Invalid(format!(
                "--working-dir: {} is neither a file, a directory nor a symbolic link",
                path.display()
            )));
        }
    }
    Ok(())
}

/// Unpacks the package at `package` into `into` (created; must not exist). Entries that would
/// land outside `into` (absolute paths, `..`) are refused by the tar reader.
pub fn unpack(package: &Path, into: &Path) -> Result<()> {
    let file = std::fs::File::open(package).map_err(|e| {
        Error::System(format!("working directory package {}: {e}", package.display()))
    })?;
    std::fs::create_dir_all(into)
        .map_err(|e| Error::System(format!("cannot create {}: {e}", into.display())))?;
    let mut archive = tar::Archive::new(file);
    archive.set_preserve_permissions(true);
    archive.set_overwrite(false);
    archive.unpack(into).map_err(|e| {
        Error::System(format!(
            "unpacking working directory package {} into {}: {e}",
            package.display(),
            into.display()
        ))
    })
}

#[cfg(test)]
#[allow(unsafe_code)] // mkfifo(3); on ARCHITECTURE.md's `unsafe` allow-list.
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::cluster::binaries::digest_of;

    fn tree(root: &Path) {
        std::fs::create_dir_all(root.join("data/sub")).unwrap();
        std::fs::write(root.join("config.yaml"), "steps: 3\n").unwrap();
        std::fs::write(root.join("data/sub/train.jsonl"), "{\"prompt\": \"1\"}\n").unwrap();
        std::fs::write(root.join("run.sh"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(root.join("run.sh"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::os::unix::fs::symlink("data/sub/train.jsonl", root.join("train.jsonl")).unwrap();
    }

    #[test]
    fn packages_are_deterministic_and_unpack_to_the_same_tree() {
        let base = tempfile::tempdir().unwrap();
        let (a, b) = (base.path().join("a"), base.path().join("b"));
        tree(&a);
        tree(&b);
        // Different times, same content: the same package.
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(b.join("config.yaml"))
            .unwrap()
            .set_modified(later)
            .unwrap();
        let (pa, pb) = (pack(&a).unwrap(), pack(&b).unwrap());
        assert_eq!(digest_of(&pa), digest_of(&pb));
        std::fs::write(b.join("config.yaml"), "steps: 4\n").unwrap();
        assert_ne!(digest_of(&pa), digest_of(&pack(&b).unwrap()), "content changes the digest");

        let package = base.path().join("package.tar");
        std::fs::write(&package, &pa).unwrap();
        let out = base.path().join("out");
        unpack(&package, &out).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("config.yaml")).unwrap(), "steps: 3\n");
        assert_eq!(
            std::fs::read_to_string(out.join("train.jsonl")).unwrap(),
            "{\"prompt\": \"1\"}\n",
            "the symbolic link is kept"
        );
        assert!(std::fs::symlink_metadata(out.join("train.jsonl")).unwrap().is_symlink());
        let mode = std::fs::metadata(out.join("run.sh")).unwrap().permissions().mode();
        assert_eq!(mode & 0o111, 0o111, "executable bits are kept");
    }

    #[test]
    fn bad_working_directories_are_named() {
        let base = tempfile::tempdir().unwrap();
        let file = base.path().join("file");
        std::fs::write(&file, "x").unwrap();
        let err = pack(&file).unwrap_err().to_string();
        assert!(err.contains("not a directory") && err.contains("file"), "{err}");
        let err = pack(&base.path().join("missing")).unwrap_err().to_string();
        assert!(err.contains("missing") && err.contains("cannot read"), "{err}");
        let dir = base.path().join("with-fifo");
        std::fs::create_dir(&dir).unwrap();
        let fifo = std::ffi::CString::new(dir.join("pipe").to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) reads a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let err = pack(&dir).unwrap_err().to_string();
        assert!(err.contains("pipe") && err.contains("neither a file"), "{err}");
    }

    #[test]
    fn a_package_cannot_write_outside_its_directory() {
        let base = tempfile::tempdir().unwrap();
        // A hand-made tar whose entry climbs out with `..`.
        let mut header = tar::Header::new_gnu();
        header.set_size(4);
        header.set_mode(0o644);
        header.set_entry_type(tar::EntryType::Regular);
        let name = b"../escaped";
        header.as_old_mut().name[..name.len()].copy_from_slice(name);
        header.set_cksum();
        let mut builder = tar::Builder::new(Vec::new());
        builder.append(&header, &b"evil"[..]).unwrap();
        let package = base.path().join("evil.tar");
        std::fs::write(&package, builder.into_inner().unwrap()).unwrap();
        let out = base.path().join("out");
        let result = unpack(&package, &out);
        assert!(!base.path().join("escaped").exists(), "nothing lands outside: {result:?}");
    }
}
