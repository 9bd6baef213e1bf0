//! `starling tracker --redis URL`: the flags of the shared-state mode (issue 14).

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
    /// Prefix of every Redis key, so that several clusters can share one Redis.
    #[arg(long, default_value = "st:", env = "STARLING_TRACKER_REDIS_PREFIX")]
    redis_prefix: String,
    /// A Redis call taking longer fails; the agent gets 503 and tries another tracker.
    #[arg(long, default_value = "1s", env = "STARLING_TRACKER_REDIS_TIMEOUT")]
    redis_timeout: humantime::Duration,
    /// How often a replica re-reads a swarm's members and hashes from Redis at most
    /// (elections and geometry are read at every announce).
    #[arg(long, default_value = "250ms", env = "STARLING_TRACKER_REDIS_REFRESH")]
    redis_refresh: humantime::Duration,
}

impl RedisArgs {
    /// The tracker, sharing its state in Redis when `--redis` is given.
    pub fn apply(&self, t: tracker::Tracker) -> Result<tracker::Tracker> {
        let Some(url) = &self.redis else {
            return Ok(t);
        };
        let opts = tracker::RedisOptions {
            prefix: self.redis_prefix.clone(),
            timeout: self.redis_timeout.into(),
            refresh: self.redis_refresh.into(),
            ..tracker::RedisOptions::new(url.clone())
        };
        Ok(t.with_redis(&opts)?)
    }
}
