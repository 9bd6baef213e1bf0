//! `starling tracker --redis URL`: the flags of the shared-state mode (issue 14). Their
//! defaults live in `tracker::RedisOptions::new`.

use anyhow::Result;
use clap::Args;

#[derive(Args, Clone, Debug, Default)]
pub struct RedisArgs {
    /// Share the swarm state with other tracker replicas through this Redis:
    /// redis://[:PASSWORD@]HOST:PORT[/DB] or rediss://… (TLS). Without it the tracker
    /// keeps its state in memory (one process, the default).
    #[arg(
        long,
        value_name = "URL",
        env = "STARLING_TRACKER_REDIS",
        hide_env_values = true
    )]
    redis: Option<String>,
    /// Prefix of every Redis key, so that several clusters can share one Redis
    /// [default: st:].
    #[arg(long, value_name = "PREFIX", env = "STARLING_TRACKER_REDIS_PREFIX")]
    redis_prefix: Option<String>,
    /// A Redis call taking longer fails; the agent gets 503 and tries another tracker
    /// [default: 1s].
    #[arg(long, value_name = "DURATION", env = "STARLING_TRACKER_REDIS_TIMEOUT")]
    redis_timeout: Option<humantime::Duration>,
    /// How often a replica re-reads a swarm's members and hashes from Redis at most
    /// (elections and geometry are read at every announce) [default: 1s, the announce
    /// interval: handouts are then as old as the bitfields in them; BENCHMARKS.md,
    /// issue 14, for what 250 ms costs].
    #[arg(long, value_name = "DURATION", env = "STARLING_TRACKER_REDIS_REFRESH")]
    redis_refresh: Option<humantime::Duration>,
}

impl RedisArgs {
    /// Whether the tracker shares its state in Redis (then prewarm jobs live there,
    /// not in the local job file).
    pub fn enabled(&self) -> bool {
        self.redis.is_some()
    }

    /// The tracker, sharing its state in Redis when `--redis` is given.
    pub fn apply(&self, t: tracker::Tracker) -> Result<tracker::Tracker> {
        let Some(url) = &self.redis else {
            return Ok(t);
        };
        let mut opts = tracker::RedisOptions::new(url.clone());
        if let Some(p) = &self.redis_prefix {
            opts.prefix = p.clone();
        }
        if let Some(d) = self.redis_timeout {
            opts.timeout = d.into();
        }
        if let Some(d) = self.redis_refresh {
            opts.refresh = d.into();
        }
        Ok(t.with_redis(&opts)?)
    }
}
