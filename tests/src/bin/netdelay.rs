//! `netdelay`: latency, jitter and loss on a network namespace's links, for
//! the network tests, on kernels without the `netem` qdisc.
//!
//! Run inside the namespace (`ip netns exec NS netdelay ...`), it binds a
//! netfilter queue and then prints `bound` on a line of its own. Packets the
//! namespace's firewall sends to that queue (`iptables -A OUTPUT ! -o lo -j
//! NFQUEUE --queue-num N`) are held for `--delay-ms` ± `--jitter-ms` each
//! (uniformly, so later packets can overtake earlier ones, as netem's jitter
//! does) and then let go, or dropped with probability `--loss`. The kernel
//! hands segments one by one (no GSO), so loss is per packet.
//!
//! With `--stats FILE`, it keeps `passed N dropped M` in the file.
//!
//! Seeded: the same seed gives the same delays and drops for the same
//! packets. It runs until killed; packets still held then are dropped by
//! the kernel with the queue.

#![forbid(unsafe_code)]

use std::{
    cmp::Reverse,
    collections::BinaryHeap,
    io::{ErrorKind, Write as _},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use nfq::{Queue, Verdict};
use provisioning_tests::sim::Rng;

#[derive(Parser, Debug)]
#[command(about = "Holds and drops packets a netfilter queue hands over")]
struct Args {
    /// The netfilter queue to bind.
    #[arg(long, default_value_t = 0)]
    queue: u16,
    /// How long each packet is held, on average.
    #[arg(long, default_value_t = 200)]
    delay_ms: u64,
    /// Each packet's hold differs from the average by up to this much.
    #[arg(long, default_value_t = 100)]
    jitter_ms: u64,
    /// The probability that a packet is dropped (0 to 1).
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where to write what was let through and what was dropped
    /// (`passed N dropped M`), at most twice a second.
    #[arg(long)]
    stats: Option<std::path::PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.loss),
        "--loss must be between 0 and 1, not {}",
        args.loss
    );
    anyhow::ensure!(
        args.jitter_ms <= args.delay_ms,
        "--jitter-ms ({}) cannot exceed --delay-ms ({})",
        args.jitter_ms,
        args.delay_ms
    );
    let mut queue = Queue::open().context("opening a netfilter queue socket (needs CAP_NET_ADMIN)")?;
    queue
        .bind(args.queue)
        .with_context(|| format!("binding netfilter queue {}", args.queue))?;
    // The verdict needs no payload; a long queue keeps the kernel from
    // dropping what is held beyond its default of 1,024 packets.
    queue.set_copy_range(args.queue, 0)?;
    queue.set_queue_max_len(args.queue, 65_535)?;
    // A burst the socket cannot buffer is lost, as on a congested link,
    // rather than ending the program.
    queue.set_recv_enobufs(false)?;
    queue.set_nonblocking(true);
    println!("bound");
    std::io::stdout().flush()?;

    let mut rng = Rng::new(args.seed);
    let mut held: BinaryHeap<Reverse<(Instant, u64)>> = BinaryHeap::new();
    let mut packets = std::collections::HashMap::new();
    let mut next = 0u64;
    let (mut passed, mut dropped) = (0u64, 0u64);
    let mut written = (Instant::now(), (0, 0));
    loop {
        let mut idle = true;
        loop {
            match queue.recv() {
                Ok(mut msg) => {
                    idle = false;
                    if rng.chance(args.loss) {
                        msg.set_verdict(Verdict::Drop);
                        queue.verdict(msg)?;
                        dropped += 1;
                        continue;
                    }
                    let spread = 2 * args.jitter_ms + 1;
                    let hold = args.delay_ms - args.jitter_ms + rng.below(spread);
                    held.push(Reverse((Instant::now() + Duration::from_millis(hold), next)));
                    packets.insert(next, msg);
                    next += 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(e).context("reading the netfilter queue"),
            }
        }
        let now = Instant::now();
        while let Some(Reverse((at, key))) = held.peek().copied() {
            if at > now {
                break;
            }
            held.pop();
            if let Some(mut msg) = packets.remove(&key) {
                msg.set_verdict(Verdict::Accept);
                queue.verdict(msg)?;
                passed += 1;
            }
        }
        if let Some(path) = &args.stats
            && written.1 != (passed, dropped)
            && written.0.elapsed() >= Duration::from_millis(500)
        {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, format!("passed {passed} dropped {dropped}\n"))?;
            std::fs::rename(&tmp, path)?;
            written = (Instant::now(), (passed, dropped));
        }
        if idle {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}
