//! The library's one error type, grouped by section.

use std::path::PathBuf;

use crate::memory::OomError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- input: the user can fix these (exit code 2) ----
    /// A profile or recipe that does not parse or does not validate.
    /// `location` is `file:line:column` where known, else the file.
    #[error("{location}: {message}")]
    Config { location: String, message: String },

    #[error(
        "unknown model `{name}`{suggestion}; known models: {known}. `--model` also takes a path to a profile YAML or a Hugging Face config.json"
    )]
    UnknownModel {
        name: String,
        suggestion: String,
        known: String,
    },

    /// A flag whose value cannot work, named as the user typed it.
    #[error("{flag}: {message}")]
    InvalidArg { flag: String, message: String },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("{0}")]
    Unavailable(String),

    // ---- resources (exit code 3) ----
    #[error(transparent)]
    Oom(#[from] OomError),
}

impl Error {
    pub fn invalid_arg(flag: &str, message: impl Into<String>) -> Self {
        Error::InvalidArg {
            flag: flag.to_string(),
            message: message.into(),
        }
    }

    /// The process exit code this error maps to: 3 for out-of-memory, 2 for the rest.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Oom(_) => 3,
            _ => 2,
        }
    }
}
