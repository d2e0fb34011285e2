//! `keel`: the KeelDB command-line tool. It parses arguments, runs one command against a store
//! directory (or the benchmark harness), and maps failures to exit codes:
//! 0 success, 1 failure (corruption found, key not found, an engine error), 2 usage error (bad
//! arguments, missing path, not a store, store locked by another process).
//!
//! This binary holds no engine logic: store commands are thin calls into `keeldb`, `bench` is
//! `keel_bench::run`.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

mod commands;
mod encoding;
mod etcd_flags;
mod load;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Exit code for a usage error (bad arguments, missing path, not a store, locked store).
pub const EXIT_USAGE: u8 = 2;
/// Exit code for a failure (corruption found, key not found, an engine error).
pub const EXIT_FAILURE: u8 = 1;

/// KeelDB command-line tool: benchmark, verify and inspect a store, and read or write keys.
#[derive(Debug, Parser)]
#[command(name = "keel", version, propagate_version = true)]
#[command(after_help = "\
Exit codes: 0 success; 1 failure (corruption found, key not found, engine error);
2 usage error (bad arguments, missing path, not a KeelDB store, store locked by another process).

Keys and values are UTF-8 text unless --hex is given. Output prints a key or value as text when it
is valid UTF-8 without control characters (and does not start with `0x`), otherwise as hex with a
`0x` prefix.")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the benchmark suites and print Markdown tables (progress goes to stderr).
    Bench(BenchCommand),
    /// Check every checksum and the state digest of a store without changing it.
    ///
    /// Exits 0 when the store is intact, 1 when corruption is found (the report names each file
    /// and byte offset), 2 on usage errors (missing path, not a store, locked).
    Verify {
        /// The store directory.
        path: PathBuf,
    },
    /// Print table sizes, WAL and checkpoint sizes, and the last recovery report.
    ///
    /// Opens the store (which runs recovery, and waits for no other handle: a store open
    /// elsewhere is reported as locked), then prints each table's key count and bytes, the WAL
    /// and checkpoint sizes, the last commit timestamp and the recovery report of this open.
    Stats {
        /// The store directory.
        path: PathBuf,
    },
    /// Print the value stored under KEY in TABLE (exit 1 when the key is absent).
    Get {
        /// The store directory.
        path: PathBuf,
        /// Table name.
        table: String,
        /// Key (UTF-8 text, or hex with --hex).
        key: String,
        #[command(flatten)]
        encoding: Encoding,
    },
    /// Store VALUE under KEY in TABLE, committed with `sync` durability.
    ///
    /// Creates the store (and the directory) when PATH does not exist yet.
    Put {
        /// The store directory.
        path: PathBuf,
        /// Table name.
        table: String,
        /// Key (UTF-8 text, or hex with --hex).
        key: String,
        /// Value (UTF-8 text, or hex with --hex).
        value: String,
        #[command(flatten)]
        encoding: Encoding,
    },
    /// Delete KEY from TABLE, committed with `sync` durability (exit 1 when the key is absent).
    Del {
        /// The store directory.
        path: PathBuf,
        /// Table name.
        table: String,
        /// Key (UTF-8 text, or hex with --hex).
        key: String,
        #[command(flatten)]
        encoding: Encoding,
    },
    /// Print the key-value pairs of TABLE in key order, one `KEY<TAB>VALUE` per line.
    Scan(ScanCommand),
    /// Run a cluster member serving etcd's v3 gRPC API, started with etcd 3.6's flags.
    ///
    /// With no flags: a one-member cluster in ./default.keel, clients on 127.0.0.1:2379.
    /// `keel serve --help` lists what KeelDB does with each etcd flag. A keel binary started
    /// under the name `etcd` (a link) runs `keel serve` with its arguments.
    Serve(Box<serve::ServeCommand>),
    /// Inspect and change cluster membership through a member's client URL.
    Cluster(serve::ClusterCommand),
    /// Make a founding member's data directory of a new cluster from a snapshot (run once per
    /// member with its `keel serve` flags, like `etcdutl snapshot restore`).
    SnapshotRestore(Box<serve::RestoreCommand>),
    /// The benchmark's helper process (recovery and scale suites); not for direct use.
    #[command(name = "__bench-child", hide = true)]
    BenchChild {
        /// The JSON task description.
        spec: String,
    },
}

/// Shared by the commands that take keys or values.
#[derive(Debug, Args)]
struct Encoding {
    /// Read keys, values and bounds as hexadecimal (an optional `0x` prefix, even digit count).
    /// Output is unaffected: text when printable UTF-8, else `0x`-prefixed hex.
    #[arg(long)]
    hex: bool,
}

#[derive(Debug, Args)]
struct BenchCommand {
    /// Fewer iterations: all suites together finish in under 60 s on a 2-core machine.
    #[arg(long)]
    quick: bool,
    /// Run only this suite; repeat for several. Default: all suites.
    #[arg(long = "suite", value_name = "NAME", value_parser = clap::builder::PossibleValuesParser::new(keel_bench::SUITES))]
    suites: Vec<String>,
    /// Peer systems to compare side by side: `none`, `all`, or a comma-separated list
    /// (sqlite, redb, lmdb, surrealkv, rocksdb, fjall). Default: every peer compiled into this
    /// build for a full run, none with --quick. Peers not compiled in are skipped with a note
    /// (build with `--features rocksdb` or `all-peers` for RocksDB).
    #[arg(long, value_name = "LIST|all|none")]
    peers: Option<String>,
    /// Also write the results as JSON (schema `keel-bench/1`) to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write DIR/report.md and PNG charts (commits/s vs writers, latency percentiles,
    /// point reads, reopen times, scale curves) that it embeds.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Create the benchmark's temporary stores under DIR (default: the system temp directory).
    /// The file system under DIR is what the figures measure.
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Smoke-test scale for the tool's own tests; the figures mean nothing.
    #[arg(long, hide = true)]
    tiny: bool,
}

#[derive(Debug, Args)]
struct ScanCommand {
    /// The store directory.
    path: PathBuf,
    /// Table name.
    table: String,
    /// Only keys starting with P.
    #[arg(long, value_name = "P")]
    prefix: Option<String>,
    /// Only keys ≥ S (inclusive).
    #[arg(long, value_name = "S")]
    start: Option<String>,
    /// Only keys < E (exclusive).
    #[arg(long, value_name = "E")]
    end: Option<String>,
    /// Descending key order.
    #[arg(long)]
    reverse: bool,
    /// Print at most N pairs.
    #[arg(long, value_name = "N")]
    limit: Option<usize>,
    #[command(flatten)]
    encoding: Encoding,
}

/// A failed command: the error and the exit code it maps to.
#[derive(Debug)]
pub struct Failure {
    /// [`EXIT_USAGE`] or [`EXIT_FAILURE`].
    pub code: u8,
    /// What to print.
    pub error: anyhow::Error,
}

impl Failure {
    /// A usage error (exit 2).
    pub fn usage(error: impl Into<anyhow::Error>) -> Self {
        Failure { code: EXIT_USAGE, error: error.into() }
    }

    /// A failure (exit 1).
    pub fn runtime(error: impl Into<anyhow::Error>) -> Self {
        Failure { code: EXIT_FAILURE, error: error.into() }
    }
}

/// Whether this binary was started under the name `etcd` (a link to keel), to stand in for
/// etcd's server: it then takes etcd's command line, as `keel serve` does.
fn started_as_etcd() -> bool {
    std::env::args_os().next().map(PathBuf::from).and_then(|p| p.file_name().map(|n| n == "etcd")).unwrap_or(false)
}

fn main() -> ExitCode {
    let outcome = if started_as_etcd() {
        let args: Vec<String> = std::env::args().skip(1).collect();
        serve::serve_args(&args)
    } else {
        // Clap prints help and version with exit 0, and argument errors with exit 2.
        run(Cli::parse().command)
    };
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            eprintln!("keel: error: {:#}", failure.error);
            ExitCode::from(failure.code)
        }
    }
}

/// Runs one command; `Ok` carries the exit code of a command that finished (verify finds
/// corruption without failing).
fn run(command: Command) -> Result<u8, Failure> {
    match command {
        Command::Bench(bench) => {
            if let Some(peers) = &bench.peers {
                keel_bench::parse_peers(peers).map_err(Failure::usage)?;
            }
            let args = keel_bench::BenchArgs {
                quick: bench.quick,
                suites: bench.suites,
                peers: bench.peers,
                json: bench.json,
                out: bench.out,
                dir: bench.dir,
                tiny: bench.tiny,
                child_command: None,
            };
            keel_bench::run(args).map_err(Failure::runtime)?;
            Ok(0)
        }
        Command::BenchChild { spec } => {
            keel_bench::child_main(&spec).map_err(Failure::runtime)?;
            Ok(0)
        }
        Command::Serve(cmd) => serve::serve(*cmd),
        Command::Cluster(cmd) => serve::cluster(cmd),
        Command::SnapshotRestore(cmd) => serve::snapshot_restore(*cmd),
        Command::Verify { path } => commands::verify(&path),
        Command::Stats { path } => commands::stats(&path).map(|()| 0),
        Command::Get { path, table, key, encoding } => {
            let key = encoding::parse_arg(&key, encoding.hex, "key").map_err(Failure::usage)?;
            commands::get(&path, &table, &key)
        }
        Command::Put { path, table, key, value, encoding } => {
            let key = encoding::parse_arg(&key, encoding.hex, "key").map_err(Failure::usage)?;
            let value = encoding::parse_arg(&value, encoding.hex, "value").map_err(Failure::usage)?;
            commands::put(&path, &table, &key, &value).map(|()| 0)
        }
        Command::Del { path, table, key, encoding } => {
            let key = encoding::parse_arg(&key, encoding.hex, "key").map_err(Failure::usage)?;
            commands::del(&path, &table, &key)
        }
        Command::Scan(scan) => {
            let hex = scan.encoding.hex;
            let bound = |text: Option<String>, what: &str| -> Result<Option<Vec<u8>>, Failure> {
                text.map(|t| encoding::parse_arg(&t, hex, what)).transpose().map_err(Failure::usage)
            };
            let request = commands::ScanRequest {
                prefix: bound(scan.prefix, "prefix")?,
                start: bound(scan.start, "start bound")?,
                end: bound(scan.end, "end bound")?,
                reverse: scan.reverse,
                limit: scan.limit,
            };
            commands::scan(&scan.path, &scan.table, request).map(|()| 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_repeated_suites_and_hidden_tiny() {
        let cli =
            Cli::try_parse_from(["keel", "bench", "--quick", "--suite", "mvcc", "--suite", "durability", "--tiny"])
                .unwrap();
        let Command::Bench(bench) = cli.command else { panic!("not bench") };
        assert_eq!(bench.suites, ["mvcc", "durability"]);
        assert!(bench.quick && bench.tiny);
        assert_eq!(bench.peers, None);
    }

    #[test]
    fn serve_takes_its_arguments_raw() {
        let cli = Cli::try_parse_from(["keel", "serve", "-name", "x", "--version", "-h", "--name=y"]).unwrap();
        let Command::Serve(_) = cli.command else { panic!("not serve") };
        let cli = Cli::try_parse_from(["keel", "snapshot-restore", "s.db", "--name", "x", "--data-dir=d"]).unwrap();
        let Command::SnapshotRestore(_) = cli.command else { panic!("not snapshot-restore") };
    }

    #[test]
    fn rejects_unknown_suite() {
        assert!(Cli::try_parse_from(["keel", "bench", "--suite", "nope"]).is_err());
    }

    #[test]
    fn scan_flags_parse() {
        let cli =
            Cli::try_parse_from(["keel", "scan", "/tmp/x", "t", "--prefix", "a", "--reverse", "--limit", "3", "--hex"])
                .unwrap();
        let Command::Scan(scan) = cli.command else { panic!("not scan") };
        assert_eq!(scan.prefix.as_deref(), Some("a"));
        assert!(scan.reverse && scan.encoding.hex);
        assert_eq!(scan.limit, Some(3));
    }
}
