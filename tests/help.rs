//! The help text, checked on the clap definition itself: every subcommand's
//! summary fits a line, every flag and every value says what it is, and a
//! default is stated once.

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
