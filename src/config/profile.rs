//! Model profiles: the built-in ones (embedded in the binary, so `memfit`
//! works from any directory) and user files, parsed with errors that name
//! `file:line:column` and suggest the closest known name.

use std::path::Path;

use super::model::ModelConfig;
use crate::{Error, Result};

macro_rules! builtin {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../profiles/models/", $name, ".yaml")))),*]
    };
}

static BUILTIN_MODELS: &[(&str, &str)] = builtin!(
    "gpt2-tiny",
    "llama-tiny",
    "moe-tiny",
    "gemma-tiny",
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "mistral-7b",
    "mixtral-8x7b",
    "qwen3-8b",
    "qwen3-30b-a3b",
    "olmoe-1b-7b",
    "phi-3-mini",
    "qwen1.5-moe-a2.7b",
    "deepseek-moe-16b",
    "gemma-2-2b",
    "gemma-2-9b",
    "gemma-2-27b",
    "gemma-3-1b",
    "gemma-3-4b",
);

/// The built-in model profiles, `(name, yaml text)`, in a stable order.
pub fn builtin_models() -> &'static [(&'static str, &'static str)] {
    BUILTIN_MODELS
}

/// Loads a model by built-in name, from a profile YAML file, or from a Hugging
/// Face `config.json`.
///
/// `spec` is a built-in name if one matches; otherwise a path when it contains
/// `/`, ends in `.yaml`/`.yml`/`.json`, or names an existing file; otherwise an
/// unknown model, with the closest built-in name suggested. A path ending in
/// `.json`, or one not ending in `.yaml`/`.yml` whose content starts with `{`,
/// is imported as a Hugging Face `config.json` ([`super::hf`]); any other is a
/// profile YAML.
pub fn load_model(spec: &str) -> Result<ModelConfig> {
    if let Some((name, text)) = BUILTIN_MODELS.iter().find(|(name, _)| *name == spec) {
        return parse_model_yaml(text, &format!("profiles/models/{name}.yaml"));
    }
    if looks_like_path(spec) || Path::new(spec).is_file() {
        let text = super::input::read_text(Path::new(spec))?;
        let yaml = spec.ends_with(".yaml") || spec.ends_with(".yml");
        let json = spec.ends_with(".json") || (!yaml && text.trim_start().starts_with('{'));
        if json {
            return super::hf::import_hf_config(&text, spec);
        }
        return parse_model_yaml(&text, spec);
    }
    let names: Vec<&str> = BUILTIN_MODELS.iter().map(|(name, _)| *name).collect();
    let suggestion = closest(spec, names.iter().copied())
        .map(|s| format!(" (did you mean `{s}`?)"))
        .unwrap_or_default();
    Err(Error::UnknownModel {
        name: spec.to_string(),
        suggestion,
        known: names.join(", "),
    })
}

/// Whether a model spec names a file rather than a built-in profile: it
/// has a directory separator or a profile's extension.
pub fn looks_like_path(spec: &str) -> bool {
    spec.contains('/')
        || spec.contains(std::path::MAIN_SEPARATOR)
        || [".yaml", ".yml", ".json"].iter().any(|x| spec.ends_with(x))
}

/// Deserialises any YAML document; errors carry `location:line:column` and a
/// did-you-mean suggestion for a misspelled key or value. A byte order mark
/// is dropped, and nesting is capped first ([`super::input::check_yaml_depth`]).
pub fn parse_yaml<T: serde::de::DeserializeOwned>(text: &str, location: &str) -> Result<T> {
    let text = super::input::strip_bom(text);
    super::input::check_yaml_depth(text, location)?;
    serde_yaml_ng::from_str(text).map_err(|e| {
        let at = match e.location() {
            Some(loc) => format!("{location}:{}:{}", loc.line(), loc.column()),
            None => location.to_string(),
        };
        Error::Config {
            location: at,
            message: explain_yaml_error(&e.to_string()),
        }
    })
}

/// `location:line` of a top-level `key:` in `text`, or just `location`.
pub fn key_location(text: &str, location: &str, key: &str) -> String {
    match key_line(text, key) {
        Some(line) => format!("{location}:{line}"),
        None => location.to_string(),
    }
}

/// `location:line:column` of the first `key:` (or of `value` in its list,
/// flow or block), else the file.
pub fn value_location(text: &str, location: &str, key: &str, value: Option<&str>) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let Some(k) = lines.iter().position(|l| {
        let t = l.trim_start();
        t.starts_with(&format!("{key}:")) && !t.starts_with('#')
    }) else {
        return location.to_string();
    };
    let key_col = lines[k].len() - lines[k].trim_start().len() + 1;
    let Some(value) = value else {
        return format!("{location}:{}:{key_col}", k + 1);
    };
    // A flow list on the key's line, or a block list below it.
    let is_token = |line: &str, at: usize| {
        let before = line[..at].chars().last();
        let after = line[at + value.len()..].chars().next();
        let sep = |c: Option<char>| c.is_none_or(|c| !c.is_alphanumeric() && c != '_');
        sep(before) && sep(after)
    };
    for (i, line) in lines.iter().enumerate().skip(k) {
        if i > k && !line.trim_start().starts_with('-') {
            break;
        }
        let start = if i == k {
            line.find(':').unwrap_or(0)
        } else {
            0
        };
        let mut from = start;
        while let Some(off) = line[from..].find(value) {
            let at_ = from + off;
            if is_token(line, at_) {
                return format!("{location}:{}:{}", i + 1, at_ + 1);
            }
            from = at_ + value.len();
        }
    }
    format!("{location}:{}:{key_col}", k + 1)
}

/// Parses and validates one model profile. `location` names the file in errors.
pub fn parse_model_yaml(text: &str, location: &str) -> Result<ModelConfig> {
    let text = super::input::strip_bom(text);
    let config: ModelConfig = parse_yaml(text, location)?;
    let invalid = |message: String| {
        let line = message
            .split('`')
            .skip(1)
            .step_by(2)
            .find_map(|field| key_line(text, field));
        Error::Config {
            location: match line {
                Some(line) => format!("{location}:{line}"),
                None => location.to_string(),
            },
            message,
        }
    };
    if config.name.trim().is_empty() {
        return Err(invalid("`name` must not be empty".into()));
    }
    config.validate().map_err(invalid)?;
    Ok(config)
}

/// Drops serde_yaml_ng's " at line N column M" (the location is reported
/// separately) and adds a suggestion for an unknown field or variant.
fn explain_yaml_error(raw: &str) -> String {
    let mut message = strip_marks(raw);
    for kind in ["unknown field `", "unknown variant `"] {
        let Some(start) = message.find(kind) else {
            continue;
        };
        let rest = &message[start + kind.len()..];
        let Some(end) = rest.find('`') else {
            continue;
        };
        let unknown = &rest[..end];
        // serde lists the candidates after "expected": "one of `a`, `b`" or "`a` or `b`".
        let candidates: Vec<&str> = match rest.find("expected") {
            Some(i) => rest[i..].split('`').skip(1).step_by(2).collect(),
            None => Vec::new(),
        };
        if let Some(s) = closest(unknown, candidates.iter().copied()) {
            let at = start + kind.len() + end + 1;
            message.insert_str(at, &format!(" (did you mean `{s}`?)"));
        }
        break;
    }
    message
}

/// Removes every " at line N column M" and " at position N" from a message.
pub(crate) fn strip_marks(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(i) = rest.find(" at ") {
        out.push_str(&rest[..i]);
        let after = &rest[i + 4..];
        if let Some(len) = mark_len(after) {
            rest = &after[len..];
        } else {
            out.push_str(" at ");
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Length of a leading "line N column M" or "position N", if `s` starts with one.
fn mark_len(s: &str) -> Option<usize> {
    fn digits(s: &str) -> usize {
        s.bytes().take_while(u8::is_ascii_digit).count()
    }
    if let Some(r) = s.strip_prefix("position ") {
        let n = digits(r);
        return (n > 0).then_some("position ".len() + n);
    }
    let r = s.strip_prefix("line ")?;
    let n = digits(r);
    let r2 = r[n..].strip_prefix(" column ")?;
    let m = digits(r2);
    (n > 0 && m > 0).then_some("line ".len() + n + " column ".len() + m)
}

/// 1-based line of a top-level `field:` key in the YAML text.
fn key_line(text: &str, field: &str) -> Option<usize> {
    text.lines()
        .position(|line| {
            line.strip_prefix(field)
                .is_some_and(|rest| rest.trim_start().starts_with(':'))
        })
        .map(|i| i + 1)
}

/// The candidate closest to `word` by edit distance, if close enough to be a
/// plausible typo.
pub(crate) fn closest<'a>(
    word: &str,
    candidates: impl Iterator<Item = &'a str>,
) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(2);
    candidates
        .map(|c| (levenshtein(word, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Edit distance (insertions, deletions, substitutions) between two strings.
fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Family;

    #[test]
    fn every_builtin_parses_and_validates() {
        assert!(!builtin_models().is_empty());
        for (name, _) in builtin_models() {
            let m = load_model(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(m.name, *name, "profile name matches its file");
            m.validate().unwrap();
        }
    }

    #[test]
    fn published_parameter_counts() {
        let expected: &[(&str, u64)] = &[
            ("gpt2", 124_439_808),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
            ("llama-3.2-1b", 1_235_814_400),
            ("llama-3.1-8b", 8_030_261_248),
            ("llama-3.1-70b", 70_553_706_496),
            // meta-llama/Llama-3.1-405B's safetensors index: 405,853,388,800.
            ("llama-3.1-405b", 405_853_388_800),
            ("mistral-7b", 7_248_023_552),
        ];
        for &(name, params) in expected {
            let m = load_model(name).unwrap();
            assert_eq!(m.num_parameters(), params, "{name}");
        }
    }

    #[test]
    fn tiny_profiles_are_byte_level() {
        let g = load_model("gpt2-tiny").unwrap();
        assert_eq!(
            (g.family, g.vocab_size, g.padded_vocab()),
            (Family::Gpt2, 256, 256)
        );
        assert!(g.tied());
        let l = load_model("llama-tiny").unwrap();
        assert_eq!(
            (l.family, l.vocab_size, l.n_kv_head()),
            (Family::Llama, 256, 2)
        );
        assert!(!l.tied());
    }

    #[test]
    fn unknown_model_suggests_closest() {
        let err = load_model("gpt2-tinyy").unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::UnknownModel { .. }), "{msg}");
        assert!(msg.contains("did you mean `gpt2-tiny`?"), "{msg}");
        assert!(msg.contains("llama-3.1-8b"), "{msg}");
        let msg = load_model("zzzzzzzzzzzz").unwrap_err().to_string();
        assert!(!msg.contains("did you mean"), "{msg}");
    }

    #[test]
    fn missing_file_is_io_error() {
        let err = load_model("no/such/profile.yaml").unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains("no/such/profile.yaml"), "{err}");
    }

    #[test]
    fn empty_name_is_rejected() {
        let text = BUILTIN_MODELS[0].1.replace("name: gpt2-tiny", "name: \"\"");
        let msg = parse_model_yaml(&text, "x.yaml").unwrap_err().to_string();
        assert!(msg.starts_with("x.yaml:2: "), "{msg}");
        assert!(msg.contains("`name` must not be empty"), "{msg}");
    }

    #[test]
    fn unknown_variant_suggests_closest() {
        let text = BUILTIN_MODELS[0].1.replace("family: gpt2", "family: gtp2");
        let msg = parse_model_yaml(&text, "x.yaml").unwrap_err().to_string();
        assert!(msg.starts_with("x.yaml:3:"), "{msg}");
        assert!(msg.contains("did you mean `gpt2`?"), "{msg}");
    }

    #[test]
    fn levenshtein_basics() {
        assert_eq!(levenshtein("", "abc"), 3);
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("n_layers", "n_layer"), 1);
        assert_eq!(levenshtein("same", "same"), 0);
    }

    #[test]
    fn strip_marks_removes_positions() {
        assert_eq!(
            strip_marks("bad at line 3 column 7, while parsing at line 1 column 1"),
            "bad, while parsing"
        );
        assert_eq!(strip_marks("look at this"), "look at this");
    }

    /// Each fixture under tests/fixtures/invalid/models states what its error
    /// must contain with `# expect: <substring>` lines; each under
    /// tests/fixtures/valid/models must load.
    #[test]
    fn fixtures() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let yaml_files = |dir: &Path| {
            let mut files: Vec<_> = std::fs::read_dir(dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|entry| entry.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect();
            files.sort();
            assert!(!files.is_empty(), "no fixtures in {}", dir.display());
            files
        };

        for path in yaml_files(&root.join("valid/models")) {
            let spec = path.to_str().unwrap();
            let m = load_model(spec).unwrap_or_else(|e| panic!("{e}"));
            m.validate().unwrap();
        }

        for path in yaml_files(&root.join("invalid/models")) {
            let spec = path.to_str().unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            let expects: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("# expect:"))
                .map(str::trim)
                .collect();
            assert!(!expects.is_empty(), "{spec}: no `# expect:` lines");
            let err = match load_model(spec) {
                Ok(_) => panic!("{spec}: loaded, but should fail"),
                Err(e) => e,
            };
            assert!(matches!(err, Error::Config { .. }), "{spec}: {err}");
            let msg = err.to_string();
            assert!(msg.starts_with(spec), "{msg}");
            for want in expects {
                assert!(
                    msg.contains(want),
                    "{spec}: error\n  {msg}\nlacks\n  {want}"
                );
            }
        }
    }
}
