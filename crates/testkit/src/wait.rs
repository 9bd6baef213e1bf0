//! Waiting in tests for something that happens in another process or task.

use std::time::Duration;

/// Checks `cond` every `every` until it holds. After `within` (counted in checks, so a
/// slow machine gets as many chances) the test fails naming `what`, instead of hanging:
/// a bound on waiting, not an assertion on how long anything takes.
pub async fn until(
    what: &str,
    every: Duration,
    within: Duration,
    mut cond: impl AsyncFnMut() -> bool,
) {
    let checks = (within.as_millis() / every.as_millis().max(1)).max(1);
    for _ in 0..checks {
        if cond().await {
            return;
        }
        tokio::time::sleep(every).await;
    }
    panic!("timed out waiting for {what}");
}
