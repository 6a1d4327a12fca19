//! `provisionctl`: the command-line client of the driver's public API.
//!
//! Only the process edges live here (parsing, the runtime, the exit code);
//! the commands are in the `provisionctl` library. Exit codes are listed in
//! `provisionctl::error::Exit` and in `provisionctl --help`.

use std::process::ExitCode;

use clap::{CommandFactory as _, Parser};
use provisionctl::{
    cli::Cli,
    commands,
    error::{CliError, Exit},
};

fn main() -> ExitCode {
    // A shell asking for completions (`COMPLETE=bash provisionctl -- ...`):
    // answered here, before anything else is printed.
    clap_complete::CompleteEnv::with_factory(Cli::command).complete();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("provisionctl: cannot start: {e}");
            return ExitCode::from(Exit::Failed.code());
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(exit) => ExitCode::from(exit.code()),
        // Told as clap tells its own usage errors (with the usage line), and
        // exit 2.
        Err(CliError::Usage(message)) => Cli::command()
            .error(clap::error::ErrorKind::MissingRequiredArgument, message)
            .exit(),
        Err(e) => {
            // Each line of a message gets the prefix, so multi-line
            // explanations stay readable and greppable.
            for line in e.to_string().lines() {
                eprintln!("provisionctl: {line}");
            }
            ExitCode::from(e.exit().code())
        }
    }
}
