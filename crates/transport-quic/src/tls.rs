//! TLS for the data plane: a self-signed certificate per transport, and a
//! client configuration that trusts exactly one certificate, named by its
//! SHA-256 fingerprint.
//!
//! There is no certificate authority and no host-name check: the sender
//! learns the receiver's fingerprint from the endpoint the receiver
//! advertised (carried by the side channel) and accepts the handshake only
//! if the certificate's SHA-256 equals it and the TLS 1.3 handshake
//! signature verifies with that certificate's key (ring's algorithms).

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, OtherError, SignatureScheme};
use sha2::{Digest, Sha256};

use crate::details::{Fingerprint, Hex};
use crate::wire::{ALPN, SERVER_NAME};

/// The SHA-256 of a DER certificate.
pub fn fingerprint_of(cert_der: &[u8]) -> Fingerprint {
    Sha256::digest(cert_der).into()
}

/// The ring crypto provider both sides use.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A transport's certificate and key.
pub(crate) struct Identity {
    pub(crate) cert: CertificateDer<'static>,
    pub(crate) key: PrivateKeyDer<'static>,
    pub(crate) fingerprint: Fingerprint,
}

/// A fresh self-signed certificate (ECDSA P-256) for [`SERVER_NAME`].
pub(crate) fn generate_identity() -> Result<Identity, rcgen::Error> {
    let certified = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_owned()])?;
    let cert = certified.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.key_pair.serialize_der()));
    let fingerprint = fingerprint_of(&cert);
    Ok(Identity { cert, key, fingerprint })
}

/// The rustls server configuration of a transport: TLS 1.3 only, its own
/// certificate, no client authentication, ALPN [`ALPN`].
pub(crate) fn server_crypto(
    provider: Arc<CryptoProvider>,
    identity: &Identity,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_no_client_auth()
        .with_single_cert(vec![identity.cert.clone()], identity.key.clone_key())?;
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

/// A quinn client configuration that accepts only the server whose
/// certificate has SHA-256 `fingerprint` (TLS 1.3, ALPN [`ALPN`], no session
/// resumption, quinn's default transport parameters).
///
/// The transport uses it for every outgoing connection; it is public so that
/// tests and tools can open a raw connection to a transport.
///
/// # Errors
///
/// A rustls error if the configuration cannot be built (not expected with
/// the ring provider).
pub fn pinned_client_config(fingerprint: Fingerprint) -> Result<quinn::ClientConfig, rustls::Error> {
    pinned_client_config_with(provider(), fingerprint)
}

pub(crate) fn pinned_client_config_with(
    provider: Arc<CryptoProvider>,
    fingerprint: Fingerprint,
) -> Result<quinn::ClientConfig, rustls::Error> {
    let verifier = PinnedServerCert { fingerprint, algorithms: provider.signature_verification_algorithms };
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN.to_vec()];
    // Every handshake verifies the certificate against the pin.
    config.resumption = rustls::client::Resumption::disabled();
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(config)
        .map_err(|e| rustls::Error::General(format!("not usable for QUIC: {e}")))?;
    Ok(quinn::ClientConfig::new(Arc::new(quic)))
}

/// The server presented a certificate other than the pinned one.
///
/// `Debug` reads like `Display`: rustls shows the error it wraps with
/// `Debug`, and this is what a failed connection reports.
#[derive(thiserror::Error)]
#[error(
    "certificate fingerprint mismatch: the endpoint pins sha256 {}, the server presented {}",
    Hex(.expected),
    Hex(.got)
)]
pub(crate) struct FingerprintMismatch {
    expected: Fingerprint,
    got: Fingerprint,
}

impl std::fmt::Debug for FingerprintMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// Accepts exactly the certificate whose SHA-256 is `fingerprint`.
#[derive(Debug)]
struct PinnedServerCert {
    fingerprint: Fingerprint,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedServerCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let got = fingerprint_of(end_entity);
        if got == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            let mismatch = FingerprintMismatch { expected: self.fingerprint, got };
            Err(rustls::Error::InvalidCertificate(CertificateError::Other(OtherError(Arc::new(mismatch)))))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // Not reached: only TLS 1.3 is offered. Verified properly regardless.
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verifier_accepts_only_the_pinned_certificate() {
        let a = generate_identity().unwrap();
        let b = generate_identity().unwrap();
        assert_ne!(a.fingerprint, b.fingerprint);
        let verifier =
            PinnedServerCert { fingerprint: a.fingerprint, algorithms: provider().signature_verification_algorithms };
        let name = ServerName::try_from(SERVER_NAME).unwrap();
        assert!(verifier.verify_server_cert(&a.cert, &[], &name, &[], UnixTime::now()).is_ok());
        let err = verifier.verify_server_cert(&b.cert, &[], &name, &[], UnixTime::now()).unwrap_err();
        assert!(err.to_string().contains("fingerprint mismatch"), "{err}");
        assert!(!verifier.supported_verify_schemes().is_empty());
        assert!(server_crypto(provider(), &a).is_ok());
        assert!(pinned_client_config(a.fingerprint).is_ok());
    }
}
