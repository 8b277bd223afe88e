//! The served model as the protocols see it: its name, limits, tokenizer
//! and chat format; conversations rendered into prompt ids; and the parser
//! that turns its output text back into content, reasoning and tool calls.
//!
//! Prompts are built on the gateway side (the socket tasks), never in the
//! engine: [`ServedModel::render`] applies the checkpoint's chat format —
//! Kimi K3 XTML, Kimi K2, or a Jinja template with Hermes-style tool calls
//! ([`crate::chat::toolcall::hermes_messages`]) — and [`ServedModel::encode`]
//! tokenizes it. When a conversation continues a previous turn whose prompt
//! and output ids are known ([`CachedPrefix`]), the new prompt reuses those
//! ids verbatim and only the new text is tokenized, so the radix cache
//! matches the whole previous turn instead of diverging where a
//! re-tokenization of the model's own output would differ. When the
//! history re-renders the output differently from what the model wrote
//! (a malformed tool call, say), the previous prompt's ids are still reused.

use std::sync::Arc;

use caracal_actors::engine::ModelInfo;
use serde_json::Value;

use super::error::{ApiError, ApiResult};
use crate::chat::render;
use crate::chat::toolcall::{
    hermes_messages, render_k2, render_k3, HermesStreamParser, K2StreamParser, K3Options,
    K3StreamParser, Message, ParseEvent, ToolChoice,
};
use crate::text::tokenizer::{ChatFormat, TextTokenizer};

/// What the gateway serves.
#[derive(Debug, Clone)]
pub struct ServedModel {
    /// Name clients use (`--served-model-name`, default the folder name).
    pub name: String,
    /// Engine-side facts (vocabulary, context length, EOS ids).
    pub info: ModelInfo,
    /// The tokenizer, if the checkpoint has one.
    pub tokenizer: Option<Arc<TextTokenizer>>,
    /// How chat prompts are rendered; `None` means completions only.
    pub format: Option<ChatFormat>,
    /// Whether the checkpoint has a vision tower (reported by `/v1/models`).
    pub vision: bool,
    /// Unix seconds the server started (the model's `created`).
    pub created: u64,
}

/// The request's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ToolChoiceSpec {
    /// The model decides.
    #[default]
    Auto,
    /// The model must not call tools: tools are left out of the prompt.
    None,
    /// The model must call a tool.
    Required,
    /// The model must call this function (the only tool declared).
    Function(String),
}

/// A conversation ready to render.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// Messages in OpenAI chat shape.
    pub messages: Vec<Message>,
    /// Tool declarations in chat shape (`{"type":"function","function":{...}}`).
    pub tools: Vec<Value>,
    /// The tool choice.
    pub tool_choice: ToolChoiceSpec,
    /// Thinking mode for formats that have one (Kimi K3); default on.
    pub thinking: bool,
}

/// A previous turn's prompt and output, as text and as the ids the engine cached.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CachedPrefix {
    /// The rendered prompt.
    pub prompt_text: String,
    /// Its ids.
    pub prompt_ids: Vec<u32>,
    /// The raw output text (special tokens kept).
    pub output_text: String,
    /// The output ids.
    pub output_ids: Vec<u32>,
}

/// The output parser for a chat format.
#[derive(Debug, Clone)]
pub enum OutputParser {
    /// Kimi K3 XTML.
    K3(K3StreamParser),
    /// Kimi K2 sections.
    K2(K2StreamParser),
    /// `<tool_call>` JSON (ChatML templates).
    Hermes(HermesStreamParser),
}

impl OutputParser {
    /// Feeds a text delta.
    pub fn push(&mut self, delta: &str) -> Vec<ParseEvent> {
        match self {
            OutputParser::K3(p) => p.push(delta),
            OutputParser::K2(p) => p.push(delta),
            OutputParser::Hermes(p) => p.push(delta),
        }
    }

    /// Ends the stream.
    pub fn finish(&mut self) -> Vec<ParseEvent> {
        match self {
            OutputParser::K3(p) => p.finish(),
            OutputParser::K2(p) => p.finish(),
            OutputParser::Hermes(p) => p.finish(),
        }
    }

    /// Whether the model's own call ids are kept (Kimi's `functions.f:0`);
    /// otherwise the gateway issues unique `call_…` ids.
    pub fn keeps_call_ids(&self) -> bool {
        !matches!(self, OutputParser::Hermes(_))
    }
}

impl ServedModel {
    /// Describes `model` served as `name`; `vision` when the checkpoint has a vision tower.
    pub fn new(
        name: &str,
        model: &dyn caracal_actors::engine::CausalLm,
        tokenizer: Option<Arc<TextTokenizer>>,
        vision: bool,
    ) -> ServedModel {
        ServedModel {
            name: name.to_string(),
            info: model.info().clone(),
            format: tokenizer.as_ref().and_then(|t| t.chat_format()),
            tokenizer,
            vision,
            created: super::unix_now(),
        }
    }

    /// The tokenizer, or a 400 naming the missing piece.
    pub fn tokenizer(&self) -> ApiResult<&TextTokenizer> {
        self.tokenizer.as_deref().ok_or_else(|| {
            ApiError::invalid(
                "unsupported_model",
                None,
                "the model has no tokenizer: send token ids to /v1/completions",
            )
        })
    }

    fn chat_format(&self) -> ApiResult<&ChatFormat> {
        self.format.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "unsupported_model",
                None,
                "the model has no chat template: use /v1/completions",
            )
        })
    }

    /// Renders a conversation into prompt text, ending with the assistant header.
    pub fn render(&self, conv: &Conversation) -> ApiResult<String> {
        let mut tools: Vec<Value> = match &conv.tool_choice {
            ToolChoiceSpec::None => Vec::new(),
            _ => conv.tools.clone(),
        };
        if let ToolChoiceSpec::Function(name) = &conv.tool_choice {
            tools.retain(|t| t["function"]["name"].as_str() == Some(name.as_str()));
        }
        let tools_opt = (!tools.is_empty()).then_some(tools.as_slice());
        match self.chat_format()? {
            ChatFormat::KimiK3 => {
                let options = K3Options {
                    thinking: conv.thinking,
                    tool_choice: match conv.tool_choice {
                        ToolChoiceSpec::Auto => ToolChoice::Auto,
                        ToolChoiceSpec::None => ToolChoice::None,
                        _ => ToolChoice::Required,
                    },
                    ..K3Options::default()
                };
                let text = render_k3(&conv.messages, tools_opt, true, &options).map_err(|e| {
                    ApiError::invalid("invalid_value", Some("messages"), e.to_string())
                })?;
                // The template's image placeholder becomes the media wrapper
                // whose `<|media_pad|>` the gateway expands.
                Ok(text.replace("<|kimi_image_placeholder|>", super::media::IMAGE_WRAPPER))
            }
            ChatFormat::KimiK2 => Ok(render_k2(&conv.messages, tools_opt, true)),
            ChatFormat::Jinja(template) => {
                let tok = self.tokenizer()?;
                let flat = hermes_messages(&conv.messages, tools_opt);
                render(
                    template,
                    &flat,
                    None,
                    true,
                    tok.bos_token.as_deref(),
                    tok.eos_token.as_deref(),
                )
                .map_err(|e| ApiError::invalid("invalid_value", Some("messages"), e.to_string()))
            }
        }
    }

    /// Tokenizes a rendered prompt, reusing `prefix`'s ids when the prompt
    /// starts with its prompt and output text (the model's own tokens, as
    /// cached), or else with its prompt text.
    pub fn encode(&self, text: &str, prefix: Option<&CachedPrefix>) -> ApiResult<Vec<u32>> {
        let tok = self.tokenizer()?;
        let enc = |s: &str| {
            tok.encode_chat(s).map_err(|e| {
                ApiError::invalid("invalid_value", None, format!("tokenizing the prompt: {e}"))
            })
        };
        if let Some(p) = prefix.filter(|p| !p.prompt_text.is_empty()) {
            if let Some(rest) = text.strip_prefix(p.prompt_text.as_str()) {
                let mut ids = p.prompt_ids.clone();
                match rest.strip_prefix(p.output_text.as_str()) {
                    Some(after) if !p.output_text.is_empty() => {
                        ids.extend_from_slice(&p.output_ids);
                        ids.extend(enc(after)?);
                    }
                    _ => ids.extend(enc(rest)?),
                }
                return Ok(ids);
            }
        }
        enc(text)
    }

    /// A fresh parser for this model's output, `None` without a chat format.
    pub fn parser(&self, thinking: bool) -> Option<OutputParser> {
        Some(match self.format.as_ref()? {
            ChatFormat::KimiK3 => OutputParser::K3(K3StreamParser::new(thinking)),
            ChatFormat::KimiK2 => OutputParser::K2(K2StreamParser::new()),
            ChatFormat::Jinja(_) => OutputParser::Hermes(HermesStreamParser::new()),
        })
    }

    /// Whether output text is decoded without special tokens before parsing:
    /// Kimi's markers are special tokens the parsers need; a ChatML model's
    /// specials (`<|im_end|>`) are only turn ends.
    pub fn skip_special_in_output(&self) -> bool {
        matches!(self.format, Some(ChatFormat::Jinja(_)) | None)
    }

    /// Raw text of output ids (special tokens kept), for [`CachedPrefix`].
    pub fn raw_text(&self, ids: &[u32]) -> String {
        self.tokenizer
            .as_deref()
            .and_then(|t| t.decode(ids, false).ok())
            .unwrap_or_default()
    }

    /// Checks a prompt against the context length.
    pub fn check_prompt(&self, prompt_tokens: usize) -> ApiResult<()> {
        let ctx = self.info.max_position;
        if prompt_tokens == 0 {
            return Err(ApiError::invalid(
                "invalid_value",
                None,
                "the prompt is empty",
            ));
        }
        if prompt_tokens >= ctx {
            return Err(ApiError::invalid(
                "context_length_exceeded",
                None,
                format!("the prompt has {prompt_tokens} tokens, but the model's context length is {ctx}"),
            ));
        }
        Ok(())
    }
}
