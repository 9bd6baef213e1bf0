//! Reading and writing the PEM files, with the permissions keys need.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// Mode of private keys and the bootstrap secret.
pub(crate) const SECRET_MODE: u32 = 0o600;
/// Mode of certificates, which are public.
pub(crate) const PUBLIC_MODE: u32 = 0o644;

pub(crate) fn read_string(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// Creates `path` with `mode`; fails with [`Error::AlreadyExists`] if it exists, since
/// overwriting a CA key or bootstrap secret would orphan every certificate and token made
/// with it.
pub(crate) fn write_new(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => Error::AlreadyExists {
                path: path.to_owned(),
            },
            _ => Error::io(path, e),
        })?;
    // The umask may have narrowed `mode`; a secret must not end up wider, a certificate
    // should be readable as promised.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| Error::io(path, e))?;
    file.write_all(contents).map_err(|e| Error::io(path, e))?;
    file.sync_all().map_err(|e| Error::io(path, e))
}

/// Replaces `path` atomically (temporary file in the same directory, then rename), so a
/// process reloading certificates never reads half a file.
pub(crate) fn write_replace(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::bad("path", format!("{} has no file name", path.display())))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let _ = fs::remove_file(&tmp);
    write_new(&tmp, contents, mode)?;
    fs::rename(&tmp, path).map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Creates `dir` (and parents) if missing; a new directory is 0700 because it holds keys.
pub(crate) fn ensure_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(|e| Error::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_new_refuses_to_overwrite_and_sets_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("secret");
        write_new(&path, b"one", SECRET_MODE).expect("first write");
        let mode = fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(
            write_new(&path, b"two", SECRET_MODE),
            Err(Error::AlreadyExists { .. })
        ));
        assert_eq!(fs::read(&path).expect("read"), b"one");
    }

    #[test]
    fn write_replace_swaps_contents_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("node.crt");
        write_replace(&path, b"old", PUBLIC_MODE).expect("write");
        write_replace(&path, b"new", PUBLIC_MODE).expect("replace");
        assert_eq!(fs::read(&path).expect("read"), b"new");
        let entries = fs::read_dir(dir.path()).expect("ls").count();
        assert_eq!(entries, 1);
        let mode = fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
    }

    #[test]
    fn read_error_names_the_path() {
        let err = read_string(Path::new("/nonexistent/starling/ca.crt")).expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/starling/ca.crt"),
            "{err}"
        );
        assert!(matches!(err, Error::Io { .. }));
    }
}
