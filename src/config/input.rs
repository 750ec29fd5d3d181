//! Reading what users hand memfit (profiles, recipes, config.json) within
//! bounds: regular files only, at most [`MAX_INPUT_BYTES`], a UTF-8 byte
//! order mark dropped, and YAML nesting capped before the parser sees it.
//! A `/dev/zero` or a FIFO is refused instead of read forever; training
//! text and sweep reports are read the same way ([`read_bounded`]), with a
//! larger bound, and a FIFO is written only when a reader is waiting
//! ([`create_output`]).

use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// The largest profile, recipe or config.json memfit reads. The largest
/// real ones are a few KiB; 4 MiB leaves room for generated grids.
pub const MAX_INPUT_BYTES: u64 = 4 << 20;

/// The deepest nesting of YAML collections memfit reads. memfit's files nest
/// three deep at most; libyaml's cost grows with the square of the flow
/// nesting (`[[[...]]]`: 40,000 levels take 3 s, 100,000 take 20 s), so the
/// depth is checked before the text reaches it.
pub const MAX_YAML_DEPTH: usize = 64;

/// The most memfit reads as training text (`--data`, all files together)
/// or as one sweep report (`memfit check`): a report of the largest grid is
/// a few hundred MiB, and text is held in memory whole.
pub const MAX_DATA_BYTES: u64 = 1 << 30;

/// Reads a regular file of at most `max` bytes. `what` names what memfit
/// reads from such files ("sweep reports"), for the errors: a device, a
/// FIFO or a directory is refused before it is opened, since `/dev/zero`
/// never ends and opening a FIFO waits for a writer.
pub fn read_bounded(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    let io = |source: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let refuse = |why: String| io(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
    // stat before open: opening a FIFO would wait for a writer.
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(refuse(format!(
            "it is not a regular file ({}); memfit reads {what} from files",
            kind_of(&meta)
        )));
    }
    let too_big = || {
        refuse(format!(
            "it is larger than {}, the most memfit reads as {what}",
            crate::units::fmt_bytes(max)
        ))
    };
    if meta.len() > max {
        return Err(too_big());
    }
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // The file may grow after the stat: read one byte past the cap to tell.
    file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > max {
        return Err(too_big());
    }
    Ok(bytes)
}

/// Reads a text file of at most [`MAX_INPUT_BYTES`], without its byte order mark.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = read_bounded(path, MAX_INPUT_BYTES, "profiles, recipes and config.json")?;
    match String::from_utf8(bytes) {
        Ok(text) => Ok(strip_bom(&text).to_string()),
        Err(e) => {
            let valid = &e.as_bytes()[..e.utf8_error().valid_up_to()];
            let before = String::from_utf8_lossy(valid);
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            Err(Error::Config {
                location: format!("{}:{line}:{column}", path.display()),
                message: "not UTF-8 text".into(),
            })
        }
    }
}

/// Creates (or truncates) a file memfit writes, such as `--timeline`. A
/// FIFO is opened only when a process reads it: opening one without a
/// reader would wait forever, so then it is an error instead. Devices
/// (`/dev/null`, `/dev/stdout`) are written as asked.
pub fn create_output(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::FileTypeExt;
    let write = |source: std::io::Error| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) {
        // A reader is there: keep this very descriptor (closing it would
        // hand the reader an end of file), its writes blocking, as a
        // regular file's are.
        return match crate::sys::fs::open_fifo_for_writing(path) {
            Ok(Some(file)) => Ok(file),
            Ok(None) => Err(write(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "it is a FIFO that no process is reading; start the reader first, or name a regular file",
            ))),
            Err(e) => Err(write(e)),
        };
    }
    std::fs::File::create(path).map_err(write)
}

fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// `text` without a leading UTF-8 byte order mark (editors on Windows write
/// one); lines and columns are then counted as an editor shows them.
pub fn strip_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// Checks that YAML collections nest at most [`MAX_YAML_DEPTH`] deep: flow
/// collections (`[`, `{`) and block indicators that open a collection on
/// the same line (`- - - x`). Indentation nests only as deep as the file is
/// wide, and serde_yaml_ng stops it at 128 levels. The error names the line
/// and column where the limit is passed.
///
/// This follows libyaml's tokens far enough to know where a node starts:
/// only there do a quote and, outside a flow collection, a bracket open
/// something; elsewhere they are part of a plain scalar.
///
/// It also refuses YAML tags (`!!str 64`), which no memfit file needs and
/// which serde would otherwise read past.
pub fn check_yaml_depth(text: &str, location: &str) -> Result<()> {
    let mut flow = 0usize;
    // Inside a quoted scalar, and which quote ends it.
    let mut quote: Option<char> = None;
    // Whether the next character starts a node.
    let mut node_start = true;
    // Inside a plain scalar, and (outside flow collections) the indentation
    // of the line it started on: a more indented line continues it.
    let mut in_plain = false;
    let mut plain_owner = 0usize;
    // The last token was a quoted scalar or a closed collection, after which
    // a flow mapping's `:` needs no space (`{"a":1}`).
    let mut json_like = false;
    // The indentation of the line that opened a block scalar (`|`, `>`).
    let mut block_scalar: Option<usize> = None;
    for (n, line) in text.split('\n').enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        if let Some(at) = block_scalar {
            if line.trim().is_empty() || indent > at {
                continue;
            }
            block_scalar = None;
        }
        if flow == 0 && quote.is_none() {
            let content = line.trim_start();
            if content.trim_end().is_empty() {
                continue;
            }
            if content.starts_with('#') {
                in_plain = false;
                continue;
            }
            let continues = in_plain && indent > plain_owner;
            in_plain = continues;
            node_start = !continues;
        }
        // Block indicators opened on this line (`- - x`).
        let mut compact = 0usize;
        let mut after_space = true;
        let mut chars = line.chars().peekable();
        let mut col = 0usize;
        while let Some(c) = chars.next() {
            col += 1;
            let next = chars.peek().copied();
            if let Some(q) = quote {
                // An escape: `\x` in double quotes, `''` in single quotes.
                let escape =
                    (c == '\\' && q == '"') || (c == '\'' && q == '\'' && next == Some('\''));
                if escape {
                    chars.next();
                    col += 1;
                } else if c == q {
                    quote = None;
                    node_start = false;
                    json_like = true;
                }
                after_space = false;
                continue;
            }
            let spaced = next.is_none_or(|c| c == ' ' || c == '\t' || c == '\r');
            match c {
                ' ' | '\t' | '\r' => {
                    after_space = true;
                    continue;
                }
                '#' if after_space => {
                    in_plain = false;
                    break;
                }
                '"' | '\'' if node_start => {
                    quote = Some(c);
                    in_plain = false;
                }
                // A tag (`!!str 64`) would make a number key's value a
                // string that serde still reads as the number: memfit's
                // values take their type from their key, so none is used.
                '!' if node_start => {
                    return Err(Error::Config {
                        location: format!("{location}:{}:{col}", n + 1),
                        message: "a YAML tag (such as `!!str`): memfit's files use none, each value's type comes from its key; remove the tag".into(),
                    });
                }
                // An anchor: the node starts after it.
                '&' if node_start => {
                    while let Some(&c) = chars.peek() {
                        if c == ' ' || c == '\t' || (flow > 0 && ",[]{}".contains(c)) {
                            break;
                        }
                        chars.next();
                        col += 1;
                    }
                    continue;
                }
                '[' | '{' if node_start || flow > 0 => {
                    flow += 1;
                    if flow + compact > MAX_YAML_DEPTH {
                        return Err(too_deep(location, n, col));
                    }
                    (node_start, in_plain, json_like) = (true, false, false);
                    after_space = false;
                    continue;
                }
                ']' | '}' if flow > 0 => {
                    flow -= 1;
                    (node_start, in_plain, json_like) = (false, false, true);
                    after_space = false;
                    continue;
                }
                ',' if flow > 0 => {
                    (node_start, in_plain, json_like) = (true, false, false);
                    after_space = false;
                    continue;
                }
                '-' | '?' if node_start && spaced => {
                    if flow == 0 {
                        compact += 1;
                        if compact > MAX_YAML_DEPTH {
                            return Err(too_deep(location, n, col));
                        }
                    }
                    after_space = false;
                    continue;
                }
                ':' if spaced || (flow > 0 && json_like) => {
                    (node_start, in_plain, json_like) = (true, false, false);
                    after_space = false;
                    continue;
                }
                '|' | '>' if node_start && flow == 0 => {
                    block_scalar = Some(indent);
                    break;
                }
                _ => {
                    if !in_plain {
                        in_plain = true;
                        plain_owner = indent;
                    }
                }
            }
            node_start = false;
            json_like = false;
            after_space = false;
        }
    }
    Ok(())
}

fn too_deep(location: &str, line: usize, col: usize) -> Error {
    Error::Config {
        location: format!("{location}:{}:{col}", line + 1),
        message: format!(
            "collections nest deeper than {MAX_YAML_DEPTH} levels; memfit's profiles and recipes nest a few levels at most"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth_error(text: &str) -> Option<String> {
        check_yaml_depth(text, "f.yaml")
            .err()
            .map(|e| e.to_string())
    }

    #[test]
    fn ordinary_yaml_passes_the_depth_check() {
        for text in [
            "model: gpt2\ngrid:\n  micro_batch: [1, 2, {a: [3]}]\n  x: \"[[[[\"\n",
            "name: 'it''s [not a list'\nnote: a[b[c[d\n# [[[[[[\n",
            "text: |\n  [[[[[[[[[[\n  {{{{{{{{\nnext: 1\n",
            "- - - x\n- [a, b]\n",
        ] {
            assert_eq!(depth_error(text), None, "{text}");
        }
        let deep_but_allowed = format!("a: {}{}\n", "[".repeat(64), "]".repeat(64));
        assert_eq!(depth_error(&deep_but_allowed), None);
    }

    #[test]
    fn deep_flow_nesting_is_located() {
        let text = format!(
            "model: x\ngrid: {}{}\n",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        let msg = depth_error(&text).unwrap();
        assert!(msg.starts_with("f.yaml:2:71: "), "{msg}");
        assert!(msg.contains("deeper than 64"), "{msg}");
        // In a flow collection, a quote inside a plain scalar hides nothing.
        let text = format!("a: [x', {}\n", "[".repeat(70));
        assert!(depth_error(&text).is_some());
        let text = format!("a:\n  {}x\n", "- ".repeat(100));
        let msg = depth_error(&text).unwrap();
        assert!(msg.starts_with("f.yaml:2:131: "), "{msg}");
    }

    #[test]
    fn non_regular_files_and_large_files_are_refused() {
        let msg = read_text(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(
            msg.contains("/dev/zero") && msg.contains("a device"),
            "{msg}"
        );
        let dir = std::env::temp_dir().join(format!("memfit-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let msg = read_text(&dir).unwrap_err().to_string();
        assert!(msg.contains("a directory"), "{msg}");
        let big = dir.join("big.yaml");
        std::fs::write(&big, vec![b'#'; MAX_INPUT_BYTES as usize + 1]).unwrap();
        let msg = read_text(&big).unwrap_err().to_string();
        assert!(msg.contains("larger than 4.00 MiB"), "{msg}");
        let bom = dir.join("bom.yaml");
        std::fs::write(&bom, "\u{feff}a: 1\n").unwrap();
        assert_eq!(read_text(&bom).unwrap(), "a: 1\n");
        std::fs::write(&bom, b"a: 1\nb: \xff\n").unwrap();
        let msg = read_text(&bom).unwrap_err().to_string();
        assert!(msg.ends_with("bom.yaml:2:4: not UTF-8 text"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
