//! The codec of both ends of a `Decide` call: what a side sends is already
//! encoded (the driver's requests by `encode_call`, the decider's answers as
//! it decides) and goes on the wire as it is; what it receives is read by
//! [`Read`] (`wire::answer` on the driver's side, `wire::request` on the
//! decider's). A message that does not read fails the call with `INTERNAL`, as
//! tonic's prost codec fails it.

use std::marker::PhantomData;

use contract::wire::{
    answer::{Answer, decode_answer},
    request::{Incoming, decode_request},
};
use prost::bytes::BufMut as _;
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::Bytes,
};

/// A message as one side of the call reads it.
pub(crate) trait Read: Sized + Send + 'static {
    fn read(buf: &mut DecodeBuf<'_>) -> Result<Self, Status>;
}

impl Read for Answer {
    fn read(buf: &mut DecodeBuf<'_>) -> Result<Self, Status> {
        decode_answer(buf).map_err(|e| Status::internal(e.to_string()))
    }
}

impl Read for Incoming {
    fn read(buf: &mut DecodeBuf<'_>) -> Result<Self, Status> {
        decode_request(buf).map_err(|e| Status::internal(e.to_string()))
    }
}

/// Sends encoded messages, receives `R`s.
pub(crate) struct Encoded<R>(PhantomData<fn() -> R>);

impl<R> Default for Encoded<R> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<R: Read> Codec for Encoded<R> {
    type Encode = Bytes;
    type Decode = R;
    type Encoder = Encoded<R>;
    type Decoder = Encoded<R>;

    fn encoder(&mut self) -> Self::Encoder {
        Encoded::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        Encoded::default()
    }
}

impl<R: Read> Encoder for Encoded<R> {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl<R: Read> Decoder for Encoded<R> {
    type Item = R;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<R>, Status> {
        R::read(buf).map(Some)
    }
}
