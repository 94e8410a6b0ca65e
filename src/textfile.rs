//! Reading the text files users hand us (configs, pipeline descriptions): at most a stated number of bytes, so a file
//! that links to `/dev/zero` or a runaway generator output is refused at once instead of read until memory runs
//! out, and a leading UTF-8 byte-order mark is dropped (editors on Windows write one; JSON parsers reject it).

use std::io::Read;
use std::path::Path;

/// Largest config file read (bytes). Real configs are a few hundred bytes.
pub(crate) const MAX_CONFIG_FILE_BYTES: u64 = 1 << 20;

/// Largest pipeline description file read (bytes): 100 000 explicit blocks of one tensor each take 8 MB; the JSON
/// tree of a file costs about 16 times its size in memory, so this also bounds what parsing may take.
pub(crate) const MAX_PIPELINE_FILE_BYTES: u64 = 16 << 20;

/// Why a text file could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TextFileError {
    /// Opening or reading failed.
    #[error("{message}")]
    Io {
        /// The I/O error's kind.
        kind: std::io::ErrorKind,
        /// The operating system's description.
        message: String,
    },
    /// The file holds more than the cap.
    #[error("the file holds more than {cap} bytes, the most a {what} may have; check the path (it may name a device or a huge file)")]
    TooLarge {
        /// What the file was meant to be (`config file`, `pipeline description`).
        what: &'static str,
        /// The cap in bytes.
        cap: u64,
    },
    /// The bytes are not UTF-8.
    #[error("the file is not UTF-8 text (invalid byte at offset {offset}); save it as UTF-8")]
    NotUtf8 {
        /// Offset of the first invalid byte.
        offset: usize,
    },
}

/// Reads `path` as UTF-8 text of at most `cap` bytes (a leading byte-order mark removed). Reads at most `cap + 1`
/// bytes whatever the file is.
pub(crate) fn read_text_capped(path: &Path, cap: u64, what: &'static str) -> Result<String, TextFileError> {
    let io = |e: std::io::Error| TextFileError::Io { kind: e.kind(), message: e.to_string() };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > cap {
        return Err(TextFileError::TooLarge { what, cap });
    }
    let text = String::from_utf8(bytes).map_err(|e| TextFileError::NotUtf8 { offset: e.utf8_error().valid_up_to() })?;
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("wf-textfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn a_file_over_the_cap_is_refused_and_a_bom_is_dropped() {
        let p = temp("small.json", b"\xef\xbb\xbf{}");
        assert_eq!(read_text_capped(&p, 5, "config file").unwrap(), "{}");
        assert_eq!(
            read_text_capped(&p, 4, "config file"),
            Err(TextFileError::TooLarge { what: "config file", cap: 4 })
        );
        let p = temp("bad.json", b"{\"a\": \"\xff\"}");
        assert_eq!(read_text_capped(&p, 100, "config file"), Err(TextFileError::NotUtf8 { offset: 7 }));
    }

    #[test]
    fn an_endless_device_is_refused_at_the_cap() {
        let t = std::time::Instant::now();
        let e = read_text_capped(Path::new("/dev/zero"), MAX_CONFIG_FILE_BYTES, "config file").unwrap_err();
        assert_eq!(e, TextFileError::TooLarge { what: "config file", cap: MAX_CONFIG_FILE_BYTES });
        assert_eq!(
            e.to_string(),
            "the file holds more than 1048576 bytes, the most a config file may have; check the path (it may name a \
             device or a huge file)"
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }
}
