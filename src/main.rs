use std::process::ExitCode;

use clap::Parser;

use memfit::cli::{Cli, Command, Format};
use memfit::config::profile::{builtin_models, load_model};
use memfit::run::{render_table, run};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run(args) => match args.options().and_then(|o| run(&o)) {
            Ok((report, failure)) => {
                match args.format {
                    Format::Json => println!(
                        "{}",
                        serde_json::to_string_pretty(&report).expect("report serialises")
                    ),
                    Format::Table => print!("{}", render_table(&report)),
                }
                match failure {
                    None => 0,
                    Some(e) => {
                        eprintln!("memfit: {e}");
                        e.exit_code()
                    }
                }
            }
            Err(e) => {
                eprintln!("memfit: {e}");
                e.exit_code()
            }
        },
        Command::Models => {
            println!("{:<16} {:<6} {:>16}", "name", "family", "parameters");
            for (name, _) in builtin_models() {
                match load_model(name) {
                    Ok(m) => println!(
                        "{:<16} {:<6} {:>16}",
                        name,
                        format!("{:?}", m.family).to_lowercase(),
                        m.num_parameters()
                    ),
                    Err(e) => eprintln!("memfit: {e}"),
                }
            }
            0
        }
    };
    ExitCode::from(code as u8)
}
