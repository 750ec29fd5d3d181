//! The help text, checked on the clap definition itself: every subcommand's
//! summary fits a line, every flag and every value says what it is, and a
//! default is stated once. And the docs: every relative link in README.md
//! and docs/*.md leads to a file that exists, and to a heading in it.

use clap::CommandFactory;
use memfit::cli::Cli;

fn walk(cmd: &clap::Command, f: &mut impl FnMut(&str, &clap::Command)) {
    f(cmd.get_name(), cmd);
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        walk(sub, f);
    }
}

/// `memfit --help` listed summaries of 150-200 characters.
#[test]
fn subcommand_summaries_fit_on_a_line() {
    for sub in Cli::command()
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
    {
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        assert!(!about.is_empty(), "{}: no summary", sub.get_name());
        assert!(
            about.chars().count() <= 80,
            "{}: summary of {} characters: {about}",
            sub.get_name(),
            about.chars().count()
        );
    }
}

/// `--format` and the value `fp32` had no description, and `plan --top`
/// printed "[default: 40] [default: 40]".
#[test]
fn every_flag_and_value_is_described_and_defaults_are_said_once() {
    walk(&Cli::command(), &mut |name, cmd| {
        for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            let id = arg.get_id().as_str();
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(!help.is_empty(), "{name} {id}: no help");
            // A switch's true/false are not values anyone types.
            let values = if arg.get_action().takes_values() {
                arg.get_possible_values()
            } else {
                Vec::new()
            };
            for v in values.iter().filter(|v| !v.is_hide_set()) {
                assert!(
                    v.get_help().is_some(),
                    "{name} {id}: value {} has no description",
                    v.get_name()
                );
            }
            if !arg.get_default_values().is_empty() {
                assert!(
                    !help.contains("[default:"),
                    "{name} {id}: the help states the default clap shows too"
                );
            }
        }
    });
}

/// The Markdown files a reader follows links through.
fn markdown_files() -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// Each `[text](target)` and `![alt](target)` outside code: fenced blocks
/// and `inline code` are skipped.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop inline code spans: the text between paired backticks.
        let prose: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].trim().to_string());
            rest = &after[end..];
        }
    }
    out
}

/// A heading's anchor as GitHub makes it: lower case, spaces to `-`,
/// punctuation other than `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// The README was split into docs/; a link that points nowhere (a file
/// renamed, a heading reworded) would send a newcomer to a 404.
#[test]
fn relative_links_in_readme_and_docs_resolve() {
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let dir = file.parent().unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').unwrap_or((link.as_str(), ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            checked += 1;
            if !target.exists() {
                broken.push(format!("{}: {link}: no such file", file.display()));
                continue;
            }
            if !anchor.is_empty() && target.extension().is_some_and(|x| x == "md") {
                let heads = anchors(&std::fs::read_to_string(&target).unwrap());
                if !heads.iter().any(|h| h == anchor) {
                    broken.push(format!(
                        "{}: {link}: no heading `{anchor}` in {}",
                        file.display(),
                        target.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(
        checked > 20,
        "only {checked} links found: is the parser right?"
    );
}

#[test]
fn link_parser_and_slugs() {
    assert_eq!(
        links("see [a](a.md) and ![b](../b.png#x) `[c](c.md)`\n```\n[d](d.md)\n```"),
        ["a.md", "../b.png#x"]
    );
    assert_eq!(
        slug(" `memfit check`: the CI gate"),
        "memfit-check-the-ci-gate"
    );
    assert_eq!(slug("`$/Mtok` and `s/Mtok`"), "mtok-and-smtok");
}
