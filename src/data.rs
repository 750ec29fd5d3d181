//! Training data: a seeded synthetic token stream, or byte-level text from files.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::rng::Rng;

/// One micro-batch: `inputs` and `targets` are `(B,T)` flattened, targets shifted by one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

/// Where tokens come from.
#[derive(Clone, Debug)]
pub enum DataSource {
    /// A first-order Markov stream over the vocabulary: each token has one seeded
    /// favourite successor, taken with probability 7/8, otherwise a uniform token.
    /// Learnable (the loss can fall from ln V towards ~0.9 nats) and endless.
    Synthetic {
        vocab: u32,
        next: Vec<u32>,
        rng: Rng,
    },
    /// Byte-level text (vocabulary 256): random windows of the concatenated files.
    Text {
        bytes: Vec<u8>,
        rng: Rng,
        origin: PathBuf,
    },
}

impl DataSource {
    pub fn synthetic(vocab: usize, seed: u64) -> Self {
        let mut table_rng = Rng::new(seed ^ 0x5EED_DA7A);
        let next = (0..vocab)
            .map(|_| table_rng.below(vocab as u64) as u32)
            .collect();
        DataSource::Synthetic {
            vocab: vocab as u32,
            next,
            rng: Rng::new(seed),
        }
    }

    /// Reads a file, or every regular file under a directory (sorted by path), as bytes.
    pub fn text(path: &Path, seed: u64) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        let mut files = Vec::new();
        if meta.is_dir() {
            collect_files(path, &mut files).map_err(io)?;
            files.sort();
        } else {
            files.push(path.to_path_buf());
        }
        // Regular files only (a device never ends, a FIFO waits for a
        // writer), and at most MAX_DATA_BYTES in all: the text is held whole.
        let max = crate::config::input::MAX_DATA_BYTES;
        let mut bytes = Vec::new();
        for f in &files {
            let what = match files.len() {
                1 => "training text (--data)",
                _ => "training text (--data, what is left of it for this file)",
            };
            let left = max - bytes.len() as u64;
            let mut b = crate::config::input::read_bounded(f, left, what)?;
            bytes.append(&mut b);
        }
        Ok(DataSource::Text {
            bytes,
            rng: Rng::new(seed),
            origin: path.to_path_buf(),
        })
    }

    /// The smallest vocabulary this source needs.
    pub fn min_vocab(&self) -> usize {
        match self {
            DataSource::Synthetic { vocab, .. } => *vocab as usize,
            DataSource::Text { .. } => 256,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            DataSource::Synthetic { .. } => "synthetic".into(),
            DataSource::Text { origin, bytes, .. } => {
                format!("text:{} ({} bytes)", origin.display(), bytes.len())
            }
        }
    }

    /// Checks the source can produce sequences of `t` tokens.
    pub fn check_seq_len(&self, t: usize) -> Result<()> {
        if let DataSource::Text { bytes, origin, .. } = self
            && bytes.len() < t + 1
        {
            return Err(Error::invalid_arg(
                "--data",
                format!(
                    "{} holds {} bytes, fewer than seq-len + 1 = {}",
                    origin.display(),
                    bytes.len(),
                    t + 1
                ),
            ));
        }
        Ok(())
    }

    pub fn next_batch(&mut self, b: usize, t: usize) -> Batch {
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        for _ in 0..b {
            let seq: Vec<u32> = match self {
                DataSource::Synthetic { vocab, next, rng } => {
                    let mut tok = rng.below(*vocab as u64) as u32;
                    let mut seq = Vec::with_capacity(t + 1);
                    for _ in 0..=t {
                        seq.push(tok);
                        tok = if rng.below(8) < 7 {
                            next[tok as usize]
                        } else {
                            rng.below(*vocab as u64) as u32
                        };
                    }
                    seq
                }
                DataSource::Text { bytes, rng, .. } => {
                    let start = rng.below((bytes.len() - t) as u64) as usize;
                    bytes[start..start + t + 1]
                        .iter()
                        .map(|&x| x as u32)
                        .collect()
                }
            };
            inputs.extend_from_slice(&seq[..t]);
            targets.extend_from_slice(&seq[1..]);
        }
        Batch { inputs, targets }
    }
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        // metadata() follows symlinks, so a linked file or folder is read too.
        let ty = std::fs::metadata(entry.path())?.file_type();
        if ty.is_dir() {
            collect_files(&entry.path(), out)?;
        } else if ty.is_file() {
            out.push(entry.path());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_is_seeded_and_shifted() {
        let mut a = DataSource::synthetic(256, 1);
        let mut b = DataSource::synthetic(256, 1);
        let x = a.next_batch(2, 16);
        assert_eq!(x, b.next_batch(2, 16));
        assert_eq!(&x.inputs[1..16], &x.targets[..15]);
        assert!(x.inputs.iter().all(|&t| t < 256));
    }

    #[test]
    fn text_reads_directories_and_checks_length() {
        let dir = std::env::temp_dir().join(format!("memfit-data-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("a.txt"), b"hello ").unwrap();
        std::fs::write(dir.join("sub/b.txt"), b"world").unwrap();
        let mut d = DataSource::text(&dir, 3).unwrap();
        assert!(d.check_seq_len(10).is_ok());
        assert!(d.check_seq_len(11).is_err());
        let batch = d.next_batch(1, 4);
        assert_eq!(batch.inputs.len(), 4);
        assert!(DataSource::text(&dir.join("missing"), 0).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
