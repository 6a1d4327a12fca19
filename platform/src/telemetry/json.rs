//! JSON log lines that carry the trace id and span id of the enclosing span,
//! so a log line leads to its trace and a trace to its log lines.
//!
//! One object per line: `timestamp`, `level`, `target`, `fields` (the event's
//! fields, `message` among them), `span` (the innermost span's name and
//! fields), and `trace_id`/`span_id` of the innermost span the
//! OpenTelemetry layer knows, when there is one and it is sampled: a span
//! that is not sampled is never exported, so its ids would lead nowhere.

use std::sync::OnceLock;

use opentelemetry::trace::TraceContextExt as _;
use serde_json::{Map, Value};
use tracing::{
    Event, Subscriber,
    dispatcher::WeakDispatch,
    field::{Field, Visit},
};
use tracing_subscriber::{
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::{JsonFields, Writer},
        time::{FormatTime as _, SystemTime},
    },
    registry::LookupSpan,
};

/// The dispatcher the OpenTelemetry layer lives in. A formatter runs inside
/// the subscriber, where the current dispatcher is not reachable through
/// `tracing`'s thread-local state, so it is remembered at initialisation.
static DISPATCH: OnceLock<WeakDispatch> = OnceLock::new();

pub(super) fn remember_dispatch(dispatch: &tracing::Dispatch) {
    let _ = DISPATCH.set(dispatch.downgrade());
}

/// The JSON log layer, writing to stderr.
pub(super) fn layer<S>() -> impl tracing_subscriber::Layer<S> + Send + Sync
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .event_format(JsonLines)
        .fmt_fields(JsonFields::new())
        .with_writer(std::io::stderr)
}

/// The event formatter.
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonLines;

/// Collects an event's fields as JSON values.
struct FieldsVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for FieldsVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0
            .insert(field.name().to_owned(), Value::from(value.to_string()));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), Value::from(format!("{value:?}")));
    }
}

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".to_owned(), Value::from(timestamp));
        line.insert("level".to_owned(), Value::from(meta.level().as_str()));
        line.insert("target".to_owned(), Value::from(meta.target()));
        let mut fields = Map::new();
        event.record(&mut FieldsVisitor(&mut fields));
        line.insert("fields".to_owned(), Value::Object(fields));

        if let Some(scope) = ctx.event_scope() {
            let dispatch = DISPATCH.get().and_then(WeakDispatch::upgrade);
            let mut innermost = true;
            for span in scope {
                if innermost {
                    let mut object = Map::new();
                    object.insert("name".to_owned(), Value::from(span.name()));
                    // The span's fields were formatted by `JsonFields` into
                    // a JSON object when it was created and recorded.
                    let ext = span.extensions();
                    if let Some(Value::Object(f)) = ext
                        .get::<FormattedFields<N>>()
                        .and_then(|f| serde_json::from_str::<Value>(f.as_str()).ok())
                    {
                        object.extend(f);
                    }
                    drop(ext);
                    line.insert("span".to_owned(), Value::Object(object));
                    innermost = false;
                }
                // The innermost span the OpenTelemetry layer knows names the
                // trace; spans it does not export (debug spans, other crates')
                // are skipped over. When that span is not sampled the line
                // names no trace: an enclosing span's ids would claim it for
                // work it did not record.
                let cx = dispatch
                    .as_ref()
                    .and_then(|d| tracing_opentelemetry::get_otel_context(&span.id(), d));
                if let Some(cx) = cx {
                    let sc = cx.span().span_context().clone();
                    if sc.is_valid() {
                        if sc.is_sampled() {
                            line.insert("trace_id".to_owned(), Value::from(sc.trace_id().to_string()));
                            line.insert("span_id".to_owned(), Value::from(sc.span_id().to_string()));
                        }
                        break;
                    }
                }
            }
        }
        let text = serde_json::to_string(&Value::Object(line)).map_err(|_| std::fmt::Error)?;
        writeln!(writer, "{text}")
    }
}
