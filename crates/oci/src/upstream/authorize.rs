//! The client side of registry auth for one request: the `Authorization` header a
//! request carries (a cached token, or Basic where the registry asked for it), and
//! answering a `401` challenge (token fetch, bounded reply, cached by scope).

use super::*;

impl Upstream {
    pub(super) fn auth_header(&self, registry: &str, scope: &str) -> Option<String> {
        if let Some(t) = self.inner.tokens.get(registry, scope) {
            return Some(format!("Bearer {t}"));
        }
        if self
            .inner
            .basic
            .lock()
            .get(registry)
            .copied()
            .unwrap_or(false)
        {
            return self
                .inner
                .credentials
                .get(registry)
                .map(Credentials::basic_header);
        }
        None
    }

    pub(super) async fn answer_challenge(
        &self,
        registry: &str,
        scope: &str,
        challenge: Challenge,
    ) -> Result<(), Error> {
        let auth_err = |m: String| Error::Auth {
            registry: registry.to_owned(),
            message: m,
        };
        match challenge {
            Challenge::Basic => {
                if !self.inner.credentials.contains_key(registry) {
                    return Err(auth_err(
                        "registry requires Basic credentials and none are configured".into(),
                    ));
                }
                self.inner.basic.lock().insert(registry.to_owned(), true);
                Ok(())
            }
            Challenge::Bearer {
                realm,
                service,
                scope: challenge_scope,
            } => {
                self.inner.tokens.invalidate(registry, scope);
                let mut url = url::Url::parse(&realm)
                    .map_err(|e| auth_err(format!("bad token realm {realm:.100}: {e}")))?;
                let loopback_realm = policy::internal_host(&url).is_some_and(|h| {
                    h == "localhost"
                        || h.ends_with(".localhost")
                        || h.parse::<std::net::IpAddr>()
                            .is_ok_and(|ip| ip.is_loopback())
                });
                if !(loopback_realm && self.is_local_configured(registry)) {
                    self.check_destination(registry, &url)?;
                }
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(s) = &service {
                        q.append_pair("service", s);
                    }
                    q.append_pair("scope", challenge_scope.as_deref().unwrap_or(scope));
                }
                let mut req = self.client_for(registry, &url).get(url.as_str());
                if let Some(c) = self.inner.credentials.get(registry) {
                    req = req.header(http::header::AUTHORIZATION, c.basic_header());
                }
                let resp = tokio::time::timeout(self.inner.cfg.response_timeout, req.send())
                    .await
                    .map_err(|_| Error::Timeout {
                        registry: registry.to_owned(),
                        message: "token endpoint".into(),
                    })?
                    .map_err(|e| self.send_error(registry, &url, e))?;
                let status = resp.status();
                if !status.is_success() {
                    return Err(auth_err(format!("token endpoint answered {status}")));
                }
                // Bounded in size and in time: an endless reply must not hold the
                // request (and its memory) forever.
                let body = tokio::time::timeout(
                    self.inner.cfg.response_timeout,
                    self.read_body(registry, resp, MAX_TOKEN_REPLY),
                )
                .await
                .map_err(|_| Error::Timeout {
                    registry: registry.to_owned(),
                    message: "token endpoint reply".into(),
                })?
                .map_err(|e| match e {
                    Error::TooLarge { limit, .. } => {
                        auth_err(format!("token reply larger than {limit} bytes"))
                    }
                    other => other,
                })?;
                let reply: TokenReply = serde_json::from_slice(&body)
                    .map_err(|e| auth_err(format!("token reply: {e}")))?;
                let token = reply
                    .token
                    .or(reply.access_token)
                    .ok_or_else(|| auth_err("token reply without token".into()))?;
                self.inner.tokens.put(
                    registry,
                    scope,
                    token,
                    reply
                        .expires_in
                        .unwrap_or(DEFAULT_TOKEN_SECONDS)
                        .min(MAX_TOKEN_SECONDS),
                );
                Ok(())
            }
        }
    }
}
