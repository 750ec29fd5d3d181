//! A property test of every parser users hand files to: plan recipes, run
//! recipes, model, hardware and network profiles, Hugging Face config.json.
//! 12,000 inputs, mutated from the shipped files and fixtures with a fixed
//! seed (so a failure reproduces: its case number and text are printed),
//! each parsed in this process. The properties: no panic; an error is bad
//! input (exit code 2) in one line naming where; a file is never read past
//! the stated bound (4 MiB), which the kernel's own count of bytes this
//! test's thread read (`/proc/thread-self/io`) checks. A sample goes
//! through the binary too, for the exit code and the single line on stderr.
//!
//! The count is the thread's, not the process's (`/proc/self/io`): this
//! test shares its process with every other test of the `it` binary, which
//! read their children's output and their files at the same time.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};

use memfit::Error;
use memfit::config::input::MAX_INPUT_BYTES;
use memfit::rng::Rng;

const CASES: usize = 12_000;
const SEED: u64 = 0x6d65_6d66_6974_2026;

#[derive(Clone, Copy, Debug)]
enum Parser {
    PlanRecipe,
    RunRecipe,
    Model,
    Hardware,
    Network,
    HfConfig,
}

const PARSERS: [Parser; 6] = [
    Parser::PlanRecipe,
    Parser::RunRecipe,
    Parser::Model,
    Parser::Hardware,
    Parser::Network,
    Parser::HfConfig,
];

/// Tokens worth splicing in: what breaks parsers (nesting, anchors, tags,
/// huge or odd numbers, other types) and what memfit's keys are.
const TOKENS: &[&str] = &[
    "[",
    "]",
    "{",
    "}",
    "[[[[[[[[",
    "{{{{",
    ": ",
    "- ",
    "- - - ",
    "? ",
    "&a ",
    "*a",
    "!!str ",
    "!!binary ",
    "!tag ",
    "|",
    ">",
    "'",
    "\"",
    "\\",
    "#",
    "~",
    "null",
    "true",
    "0",
    "-1",
    "1e308",
    "-1e308",
    ".nan",
    ".inf",
    "NaN",
    "18446744073709551616",
    "9223372036854775808",
    "340282366920938463463374607431768211456",
    "0x10",
    "1_000",
    "4294967296",
    "1e-320",
    "\t",
    "\r\n",
    "\u{feff}",
    "\u{0}",
    "é",
    "∞",
    "model: ",
    "seq_len: ",
    "global_batch: ",
    "grid:\n",
    "micro_batch: ",
    "n_layer: ",
    "d_model: ",
    "n_head: ",
    "vocab_size: ",
    "memory: ",
    "device: ",
    "limit=",
    "cpu:limit=1B",
    "meta:limit=18446744073709551616B",
    "/dev/zero",
    "/proc/self/mem",
    ".",
    "..",
    "/",
    "hidden_size",
    "num_attention_heads",
    "\"num_hidden_layers\": ",
    ",",
    "1024",
    "65536",
    "2147483647",
];

/// The seed corpus: every shipped profile and recipe, and the fixtures.
fn corpus() -> Vec<(Parser, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    let mut add = |parser: Parser, dir: &str, ext: &str| {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else {
            return;
        };
        let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files
            .into_iter()
            .filter(|f| f.to_string_lossy().ends_with(ext))
        {
            out.push((parser, std::fs::read_to_string(f).unwrap()));
        }
    };
    add(Parser::PlanRecipe, "recipes", ".yaml");
    add(Parser::PlanRecipe, "tests/fixtures/invalid/plans", ".yaml");
    add(Parser::PlanRecipe, "tests/fixtures/sweep", ".yaml");
    add(Parser::PlanRecipe, "tests/fixtures/reports", ".yaml");
    add(Parser::RunRecipe, "tests/fixtures/invalid/recipes", ".yaml");
    add(Parser::Model, "profiles/models", ".yaml");
    add(Parser::Model, "tests/fixtures/valid/models", ".yaml");
    add(Parser::Model, "tests/fixtures/invalid/models", ".yaml");
    add(Parser::Hardware, "profiles/hardware", ".yaml");
    add(Parser::Network, "profiles/networks", ".yaml");
    add(Parser::HfConfig, "tests/fixtures/hf", ".json");
    out.push((
        Parser::RunRecipe,
        "model: gpt2-tiny\nseq_len: 16\nmicro_batch: 2\nsteps: 3\ndevice: cpu:limit=64MiB\n".into(),
    ));
    for p in PARSERS {
        assert!(
            out.iter()
                .any(|(q, _)| format!("{q:?}") == format!("{p:?}")),
            "no {p:?} seeds"
        );
    }
    out
}

/// `seed` changed by one to four random edits.
fn mutate(rng: &mut Rng, seed: &str, others: &[(Parser, String)]) -> String {
    let mut b: Vec<u8> = seed.as_bytes().to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() as u64 + 1) as usize;
        match rng.below(7) {
            // Flip a byte (possibly into invalid UTF-8).
            0 if !b.is_empty() => {
                let i = at.min(b.len() - 1);
                b[i] ^= 1 << rng.below(8);
            }
            // Splice a token.
            1 | 2 => {
                let t = TOKENS[rng.below(TOKENS.len() as u64) as usize];
                b.splice(at..at, t.bytes());
            }
            // Delete a range.
            3 => {
                let end = (at + rng.below(64) as usize).min(b.len());
                b.drain(at..end);
            }
            // Repeat a range (long lines, duplicate keys).
            4 => {
                let end = (at + rng.below(200) as usize).min(b.len());
                let piece = b[at..end].to_vec();
                for _ in 0..1 + rng.below(8) {
                    b.splice(at..at, piece.iter().copied());
                }
            }
            // A line from another file.
            5 => {
                let other = &others[rng.below(others.len() as u64) as usize].1;
                let lines: Vec<&str> = other.lines().collect();
                if !lines.is_empty() {
                    let line = lines[rng.below(lines.len() as u64) as usize];
                    b.splice(at..at, format!("{line}\n").into_bytes());
                }
            }
            // Nest deep.
            _ => {
                let n = rng.below(200) as usize;
                let open = if rng.below(2) == 0 { "[" } else { "- " };
                b.splice(at..at, open.repeat(n).into_bytes());
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// Bytes this thread has read through read(2) and friends, by the kernel's
/// count: the parsers read on the caller's thread, and the other tests of
/// the `it` binary read (their children's output, their files) on theirs,
/// in the same process.
fn bytes_read() -> u64 {
    let io = std::fs::read_to_string("/proc/thread-self/io").unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Parses `text` as `parser` would get it: in memory where the parser
/// takes text, else from `file`.
fn parse(parser: Parser, text: &str, file: &Path) -> Result<(), Error> {
    let location = file.display().to_string();
    match parser {
        Parser::PlanRecipe => memfit::plan::load_recipe(file).map(drop),
        Parser::RunRecipe => memfit::run::recipe::load_run_recipe(file).map(drop),
        Parser::Model => memfit::config::profile::parse_model_yaml(text, &location).map(drop),
        Parser::Hardware => {
            memfit::config::hardware::parse_hardware_yaml(text, &location).map(drop)
        }
        Parser::Network => memfit::config::hardware::parse_network_yaml(text, &location).map(drop),
        Parser::HfConfig => memfit::config::hf::import_hf_config(text, &location).map(drop),
    }
}

#[test]
fn mutated_recipes_profiles_and_configs_are_errors_never_panics_or_unbounded_reads() {
    // Memory-backed where there is one: thousands of rewrites of one file
    // on ext4 each flush it to disk (its truncate-and-rewrite heuristic).
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("memfit-fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let seeds = corpus();
    let mut rng = Rng::new(SEED);
    let (mut ok, mut refused) = (0usize, 0usize);
    let mut through_binary = 0;
    let start = std::time::Instant::now();
    for case in 0..CASES {
        let (parser, seed) = &seeds[rng.below(seeds.len() as u64) as usize];
        let mut text = mutate(&mut rng, seed, &seeds);
        // Now and then, past the bound: it must be refused unread.
        let oversized = case % 997 == 0;
        if oversized {
            let pad = "# padding\n".repeat((MAX_INPUT_BYTES / 10) as usize + 1);
            text.push_str(&pad);
        }
        let file = dir.join(match parser {
            Parser::HfConfig => "config.json",
            _ => "input.yaml",
        });
        let from_file = matches!(parser, Parser::PlanRecipe | Parser::RunRecipe);
        if from_file {
            std::fs::write(&file, &text).unwrap();
        }
        let before = bytes_read();
        let got = std::panic::catch_unwind(AssertUnwindSafe(|| parse(*parser, &text, &file)));
        let read = bytes_read() - before;
        let show = || {
            let head: String = text.chars().take(600).collect();
            format!("case {case} ({parser:?}), input:\n{head}")
        };
        let Ok(result) = got else {
            panic!("panicked on {}", show());
        };
        // A file parser reads its file (at most the bound plus the byte
        // that tells it is past it) and perhaps one profile it names.
        assert!(
            read <= 2 * (MAX_INPUT_BYTES + 1) + (64 << 10),
            "read {read} bytes on {}",
            show()
        );
        let refused_here = result.is_err();
        match result {
            Ok(()) => {
                // The bound is on files; the in-memory parsers take text as given.
                assert!(
                    !(oversized && from_file),
                    "an oversized file parsed: {}",
                    show()
                );
                ok += 1;
            }
            Err(e) => {
                refused += 1;
                let msg = e.to_string();
                assert_eq!(e.exit_code(), 2, "{msg}: {}", show());
                assert!(
                    !msg.contains('\n'),
                    "a multi-line error:\n{msg}\non {}",
                    show()
                );
                assert!(!msg.trim().is_empty(), "an empty error on {}", show());
                if oversized && from_file {
                    assert!(msg.contains("larger than"), "{msg}: {}", show());
                    assert!(read < 1 << 20, "read {read} bytes of an oversized file");
                }
            }
        }
        // A sample of the refused ones through the binary: exit 2 and one
        // line on stderr (the accepted ones would be planned, which is not
        // what this tests).
        if case % 50 == 0 && refused_here && matches!(parser, Parser::PlanRecipe) {
            through_binary += 1;
            let o = std::process::Command::new(env!("CARGO_BIN_EXE_memfit"))
                .env("MEMFIT_NO_GPU_CALIBRATION", "1")
                .args(["plan", file.to_str().unwrap()])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(!err.contains("panicked"), "{err}: {}", show());
            assert_eq!(o.status.code(), Some(2), "{err}: {}", show());
            let lines: Vec<&str> = err.lines().filter(|l| !l.contains("warning:")).collect();
            assert_eq!(lines.len(), 1, "{err}: {}", show());
        }
    }
    // A file the size of the bound's 256 times over, sparse: refused from
    // its size, without a byte of it read.
    let big = dir.join("huge.yaml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let before = bytes_read();
    let e = memfit::plan::load_recipe(&big).unwrap_err();
    assert!(bytes_read() - before < 64 << 10);
    assert!(e.to_string().contains("larger than"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "{CASES} cases in {:.1} s: {ok} parsed, {refused} refused, {through_binary} through the binary",
        start.elapsed().as_secs_f64()
    );
    // The mutations must both keep some inputs valid and break most.
    assert!(
        ok > CASES / 50 && refused > CASES / 2,
        "{ok} parsed, {refused} refused"
    );
}
