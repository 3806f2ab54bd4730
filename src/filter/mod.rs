//! The proxy-wasm glue: reads the config, asks the companion, and applies the decision.
//! All judgement lives in the pure modules; this layer only moves data between them and
//! the host. Host calls go through `proxy_wasm::hostcalls` and every status is handled:
//! a panic here would abort the VM and take the worker's traffic with it.

mod host;

use crate::config::{Config, FailureMode, MissingIdentity};
use crate::decision::{self, Header, LocalReply, DEGRADED_HEADER};
use crate::identity::{find_credential, tenant_id, ANONYMOUS_TENANT};
use crate::protocol::{
    BucketSpec, TokenBucketReply, TokenBucketRequest, TOKEN_BUCKET_PATH, TOKEN_HEADER,
};
use host::Metric;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { config: None }) });
}}

struct Root {
    config: Option<Rc<Config>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = host::plugin_configuration();
        match Config::from_json(&bytes) {
            Ok(config) => {
                host::define_metrics();
                log::info!(
                    "llm-ratelimit: configured {} limit(s) in domain {:?}, companion {:?}",
                    config.limits.len(),
                    config.domain,
                    config.companion.upstream
                );
                self.config = Some(Rc::new(config));
                true
            }
            Err(err) => {
                // Returning false makes the host refuse the config; this line says why.
                log::error!("llm-ratelimit: {err}");
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; a VM whose config was refused gets pass-through contexts.
        Some(Box::new(RequestFilter {
            config: self.config.clone(),
            limits: Vec::new(),
            response_headers: Vec::new(),
            awaiting_decision: false,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct RequestFilter {
    config: Option<Rc<Config>>,
    /// The buckets asked for, to check the reply against.
    limits: Vec<BucketSpec>,
    /// Added to the upstream's response once it arrives.
    response_headers: Vec<Header>,
    /// A callout is out: the request must not move on, body and trailers included.
    awaiting_decision: bool,
}

/// What to do with the paused request.
enum Verdict {
    Forward(Vec<Header>),
    Reply(LocalReply),
}

impl RequestFilter {
    fn start(&mut self, config: &Config) -> Result<(), Verdict> {
        let credential = find_credential(&config.identity.sources, host::request_header);
        let tenant = match (credential, config.identity.missing) {
            (Some(credential), _) => tenant_id(&credential),
            (None, MissingIdentity::Anonymous) => ANONYMOUS_TENANT.to_string(),
            (None, MissingIdentity::Reject) => {
                host::increment(Metric::Unidentified);
                return Err(Verdict::Reply(decision::missing_identity()));
            }
        };
        self.limits = config
            .limits
            .iter()
            .map(|limit| BucketSpec {
                name: limit.name.clone(),
                capacity: limit.requests,
                window_ms: limit.window.0.as_millis() as u64,
                cost: 1,
            })
            .collect();
        let request = TokenBucketRequest {
            domain: config.domain.clone(),
            tenant,
            limits: self.limits.clone(),
        };
        let body = serde_json::to_vec(&request)
            .map_err(|_| self.companion_failed(config, "cannot encode request"))?;
        let companion = &config.companion;
        let headers = vec![
            (":method", "POST"),
            (":path", TOKEN_BUCKET_PATH),
            (":authority", companion.authority()),
            ("content-type", "application/json"),
            (TOKEN_HEADER, companion.token.expose()),
        ];
        host::dispatch(&companion.upstream, headers, &body, companion.timeout.0)
            .map_err(|why| self.companion_failed(config, &why))
    }

    fn decide(&mut self, config: &Config, body_size: usize) -> Verdict {
        let status = host::callout_status();
        if status != Some(200) {
            return self.companion_failed(config, &format!("companion answered status {status:?}"));
        }
        let reply = match serde_json::from_slice::<TokenBucketReply>(&host::callout_body(body_size))
        {
            Ok(reply) if reply.limits.len() == self.limits.len() => reply,
            Ok(_) => {
                return self
                    .companion_failed(config, "companion reply has the wrong number of limits")
            }
            Err(err) => {
                return self
                    .companion_failed(config, &format!("companion reply is not valid: {err}"))
            }
        };
        if reply.allowed {
            host::increment(Metric::Allowed);
            Verdict::Forward(decision::request_headers(&reply))
        } else {
            host::increment(Metric::Limited);
            let window_ms_of = |name: &str| {
                self.limits
                    .iter()
                    .find(|l| l.name == name)
                    .map(|l| l.window_ms)
            };
            Verdict::Reply(decision::rejection(&reply, window_ms_of))
        }
    }

    fn companion_failed(&self, config: &Config, why: &str) -> Verdict {
        host::increment(Metric::CompanionFailures);
        log::warn!(
            "llm-ratelimit: no decision from the companion ({why}); failure_mode {:?}",
            config.failure_mode
        );
        match config.failure_mode {
            FailureMode::Allow => {
                Verdict::Forward(vec![(DEGRADED_HEADER, "companion-unavailable".to_string())])
            }
            FailureMode::Deny => Verdict::Reply(decision::limiter_unavailable()),
        }
    }

    fn hold_while_deciding(&self) -> Action {
        if self.awaiting_decision {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// Carries a verdict out. `paused` says whether the request is waiting on us.
    fn apply(&mut self, verdict: Verdict, paused: bool) -> Action {
        self.awaiting_decision = false;
        match verdict {
            Verdict::Forward(headers) => {
                self.response_headers = headers;
                if paused {
                    host::resume_request();
                }
                Action::Continue
            }
            Verdict::Reply(reply) => {
                self.response_headers.clear();
                host::send_reply(&reply);
                Action::Pause
            }
        }
    }
}

impl Context for RequestFilter {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        body_size: usize,
        _trailers: usize,
    ) {
        let Some(config) = self.config.clone() else {
            return;
        };
        let verdict = self.decide(&config, body_size);
        self.apply(verdict, true);
    }
}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let Some(config) = self.config.clone() else {
            return Action::Continue;
        };
        match self.start(&config) {
            // With `allow_on_headers_stop_iteration` the headers wait here for the decision.
            Ok(()) => {
                self.awaiting_decision = true;
                Action::Pause
            }
            Err(verdict) => self.apply(verdict, false),
        }
    }

    // Envoy with `allow_on_headers_stop_iteration` still delivers the body while the
    // headers are held, and a Continue here would send headers and body upstream before
    // the decision: hold (and buffer) them until the callout answers.
    fn on_http_request_body(&mut self, _body_size: usize, _end_of_stream: bool) -> Action {
        self.hold_while_deciding()
    }

    fn on_http_request_trailers(&mut self, _trailers: usize) -> Action {
        self.hold_while_deciding()
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in self.response_headers.drain(..) {
            host::set_response_header(name, &value);
        }
        Action::Continue
    }
}
