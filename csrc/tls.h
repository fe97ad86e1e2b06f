// TLS for the data plane (csrc/data_plane.h), on OpenSSL when the build found it.
//
// A Context is made once per server or per client configuration from PEM bytes: the same
// certificates and verification as the control plane's gRPC credentials
// (elastic_emb/ps/wire/security.py). A Session is one connection's TLS state over memory
// buffers, so the caller keeps its own socket I/O (blocking or not): bytes read from the
// socket go in with Feed, decrypted bytes come out of Read; bytes to send go in with Write
// and their records come out of TakeOutput, to be written to the socket in that order.
//
//   auto context = tls::Context::Client(ca_pem, cert_pem, key_pem);
//   tls::Session s(context, "127.0.0.1");  // checks the server's certificate names it
//   while (!s.Handshake()) { send(s.TakeOutput()); s.Feed(recv()); }
//
// What is checked: a server presents its certificate chain; with a client CA it requires a
// client certificate that CA signed (no name is checked on it, as gRPC does). A client trusts
// only its CA and checks that the server's certificate names the host it connected to: an IP
// address against the certificate's IP address names, a host name against its DNS names (with
// a wildcard only as a whole left-most label). TLS 1.2 or 1.3.
//
// Thread safety: a Context is immutable once made and shared freely. A Session's calls are
// serialized by its own mutex (one thread may Read while another Writes); none blocks.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

namespace elastic_emb {
namespace tls {

// Whether this build has TLS (it found OpenSSL); without it, making a Context throws.
bool Available();

class Context {
 public:
  // A server's: its certificate chain and key; with `client_ca_pem` (non-empty), clients
  // must present a certificate that CA signed. Throws std::invalid_argument naming what is
  // wrong (not PEM, a key that is not the certificate's).
  static std::shared_ptr<Context> Server(const std::string& cert_pem, const std::string& key_pem,
                                         const std::string& client_ca_pem);
  // A client's: the CA it trusts and, for mutual TLS, its certificate and key (both or
  // neither empty).
  static std::shared_ptr<Context> Client(const std::string& ca_pem, const std::string& cert_pem,
                                         const std::string& key_pem);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  bool server() const { return server_; }
  void* native() const { return ctx_; }  // the SSL_CTX

 private:
  Context(void* ctx, bool server) : ctx_(ctx), server_(server) {}
  void* ctx_;
  bool server_;
};

class Session {
 public:
  // A connection's TLS: a server's (peer_host unused) or a client's that checks the server's
  // certificate names `peer_host` (an IP address or a host name, brackets allowed).
  Session(std::shared_ptr<Context> context, const std::string& peer_host);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Ciphertext read from the socket.
  void Feed(const char* data, size_t size);
  // Advances the handshake: true once it is done; false while it needs more input (what
  // it has to send is in TakeOutput). Throws std::runtime_error if it failed (the peer's
  // certificate refused, not TLS at all): the message says why.
  bool Handshake();
  // Up to `room` decrypted bytes into `out`: how many; 0 when it needs more input (or
  // the handshake is still going on); -1 once the peer closed the session. Throws
  // std::runtime_error on a broken or forged record.
  long Read(char* out, size_t room);
  // Encrypts `size` bytes (it takes them all); their records go to TakeOutput.
  void Write(const char* data, size_t size);
  // Appends the records waiting to be sent (handshake messages, alerts, encrypted data)
  // to `out`; whether there were any.
  bool TakeOutput(std::string* out);
  // Whether encrypted bytes wait in TakeOutput (a cheap check).
  bool HasOutput();

 private:
  friend struct Buffers;  // (the BIO over input_ and output_)
  std::string Error(const char* what);
  std::mutex mu_;
  std::shared_ptr<Context> context_;
  void* ssl_ = nullptr;  // SSL, guarded by mu_; its BIO reads input_ and appends to output_
  std::string input_;    // ciphertext fed, from input_at_ on not read yet (mu_)
  size_t input_at_ = 0;
  std::string output_;  // records to send (mu_)
};

}  // namespace tls
}  // namespace elastic_emb
