#include "tls.h"

#include <stdexcept>

#ifndef EE_WITH_TLS
#define EE_WITH_TLS 0
#endif

#if EE_WITH_TLS
#include <arpa/inet.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>
#endif

namespace elastic_emb {
namespace tls {

bool Available() { return EE_WITH_TLS != 0; }

#if EE_WITH_TLS
namespace {

SSL_CTX* Ctx(const Context& c) { return static_cast<SSL_CTX*>(c.native()); }

// The newest OpenSSL error of this thread, in words (the queue cleared).
std::string LastError() {
  std::string text;
  unsigned long code;
  while ((code = ERR_get_error()) != 0) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    text = buffer;
  }
  return text.empty() ? "no detail" : text;
}

// Every certificate of a PEM text, in order; throws if there is none.
std::vector<X509*> Certificates(const std::string& pem, const std::string& what) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  std::vector<X509*> out;
  while (X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) out.push_back(cert);
  BIO_free(bio);
  ERR_clear_error();  // (the end of the text reads as an error)
  if (out.empty()) throw std::invalid_argument("TLS: the " + what + " holds no PEM certificate");
  return out;
}

// Adds `ca_pem`'s certificates to what `ctx` trusts; their names, for a server's list of
// acceptable client CAs.
void Trust(SSL_CTX* ctx, const std::string& ca_pem, const std::string& what, bool name_them) {
  X509_STORE* store = SSL_CTX_get_cert_store(ctx);
  for (X509* cert : Certificates(ca_pem, what)) {
    X509_STORE_add_cert(store, cert);
    if (name_them) SSL_CTX_add_client_CA(ctx, cert);
    X509_free(cert);
  }
  ERR_clear_error();  // (a certificate already in the store)
}

// The certificate chain and key `ctx` presents.
void Present(SSL_CTX* ctx, const std::string& cert_pem, const std::string& key_pem) {
  std::vector<X509*> chain = Certificates(cert_pem, "certificate");
  bool ok = SSL_CTX_use_certificate(ctx, chain[0]) == 1;
  X509_free(chain[0]);
  for (size_t i = 1; i < chain.size(); ++i) {
    if (ok) ok = SSL_CTX_add0_chain_cert(ctx, chain[i]) == 1;  // (takes it)
    if (!ok) X509_free(chain[i]);
  }
  if (!ok) throw std::invalid_argument("TLS: cannot use the certificate: " + LastError());
  BIO* bio = BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size()));
  EVP_PKEY* key = PEM_read_bio_PrivateKey(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (key == nullptr) {
    throw std::invalid_argument("TLS: the key is not an unencrypted PEM private key: " +
                                LastError());
  }
  ok = SSL_CTX_use_PrivateKey(ctx, key) == 1 && SSL_CTX_check_private_key(ctx) == 1;
  EVP_PKEY_free(key);
  if (!ok) {
    throw std::invalid_argument("TLS: the key is not the certificate's: " + LastError());
  }
}

}  // namespace

// The BIO under a Session's SSL: it reads the ciphertext fed and appends the records made
// to the session's own strings (no copy through OpenSSL's memory BIOs, no zero-filling).
struct Buffers {
  static Session* Of(BIO* bio) { return static_cast<Session*>(BIO_get_data(bio)); }
  static int Write(BIO* bio, const char* data, int size) {
    Of(bio)->output_.append(data, static_cast<size_t>(size));
    return size;
  }
  static int Read(BIO* bio, char* out, int room) {
    Session* s = Of(bio);
    BIO_clear_retry_flags(bio);
    const size_t left = s->input_.size() - s->input_at_;
    if (left == 0) {
      BIO_set_retry_read(bio);  // more later: not the end
      return -1;
    }
    const size_t take = std::min(left, static_cast<size_t>(room));
    std::memcpy(out, s->input_.data() + s->input_at_, take);
    s->input_at_ += take;
    if (s->input_at_ == s->input_.size()) {
      s->input_.clear();
      s->input_at_ = 0;
    }
    return static_cast<int>(take);
  }
  static long Control(BIO* bio, int command, long, void*) {
    switch (command) {
      case BIO_CTRL_FLUSH:
        return 1;
      case BIO_CTRL_PENDING:
        return static_cast<long>(Of(bio)->input_.size() - Of(bio)->input_at_);
      case BIO_CTRL_WPENDING:
        return static_cast<long>(Of(bio)->output_.size());
      default:
        return 0;
    }
  }
  static int Create(BIO* bio) {
    BIO_set_init(bio, 1);
    return 1;
  }
  static BIO_METHOD* Method() {
    static BIO_METHOD* method = [] {
      BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "elastic_emb");
      BIO_meth_set_write(m, Write);
      BIO_meth_set_read(m, Read);
      BIO_meth_set_ctrl(m, Control);
      BIO_meth_set_create(m, Create);
      return m;
    }();
    return method;
  }
};

namespace {

SSL_CTX* NewCtx(bool server) {
  SSL_CTX* ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
  if (ctx == nullptr) throw std::runtime_error("TLS: cannot make a context: " + LastError());
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  // One session per connection, which lives long: no resumption, no tickets (so nothing
  // is sent after the handshake but data), no renegotiation.
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET | SSL_OP_NO_RENEGOTIATION);
  // AES-128-GCM first: as safe for this use, and cheaper per record than AES-256.
  SSL_CTX_set_ciphersuites(
      ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256");
  if (server) SSL_CTX_set_num_tickets(ctx, 0);
  return ctx;
}

}  // namespace

std::shared_ptr<Context> Context::Server(const std::string& cert_pem, const std::string& key_pem,
                                         const std::string& client_ca_pem) {
  SSL_CTX* ctx = NewCtx(true);
  std::shared_ptr<Context> made(new Context(ctx, true));
  Present(ctx, cert_pem, key_pem);
  if (!client_ca_pem.empty()) {
    Trust(ctx, client_ca_pem, "client CA certificate", true);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return made;
}

std::shared_ptr<Context> Context::Client(const std::string& ca_pem, const std::string& cert_pem,
                                         const std::string& key_pem) {
  if (cert_pem.empty() != key_pem.empty()) {
    throw std::invalid_argument("TLS: a client certificate and its key go together");
  }
  SSL_CTX* ctx = NewCtx(false);
  std::shared_ptr<Context> made(new Context(ctx, false));
  Trust(ctx, ca_pem, "CA certificate", false);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  if (!cert_pem.empty()) Present(ctx, cert_pem, key_pem);
  return made;
}

Context::~Context() { SSL_CTX_free(Ctx(*this)); }

Session::Session(std::shared_ptr<Context> context, const std::string& peer_host)
    : context_(std::move(context)) {
  SSL* ssl = SSL_new(Ctx(*context_));
  if (ssl == nullptr) throw std::runtime_error("TLS: cannot make a session: " + LastError());
  BIO* bio = BIO_new(Buffers::Method());
  if (bio == nullptr) {
    SSL_free(ssl);
    throw std::runtime_error("TLS: cannot make a session: " + LastError());
  }
  BIO_set_data(bio, this);
  SSL_set_bio(ssl, bio, bio);  // (one BIO both ways: SSL takes it once)
  ssl_ = ssl;
  if (context_->server()) {
    SSL_set_accept_state(ssl);
    return;
  }
  std::string host = peer_host;
  if (host.size() > 1 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  unsigned char address[16];
  const bool ip = inet_pton(AF_INET, host.c_str(), address) == 1 ||
                  inet_pton(AF_INET6, host.c_str(), address) == 1;
  X509_VERIFY_PARAM* param = SSL_get0_param(ssl);
  bool ok;
  if (ip) {
    ok = X509_VERIFY_PARAM_set1_ip_asc(param, host.c_str()) == 1;
  } else {
    X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    ok = X509_VERIFY_PARAM_set1_host(param, host.c_str(), host.size()) == 1 &&
         SSL_set_tlsext_host_name(ssl, host.c_str()) == 1;
  }
  if (!ok) {
    SSL_free(ssl);
    ERR_clear_error();
    throw std::invalid_argument("TLS: cannot check the server's name against '" + host + "'");
  }
  SSL_set_connect_state(ssl);
}

Session::~Session() { SSL_free(static_cast<SSL*>(ssl_)); }

std::string Session::Error(const char* what) {
  SSL* ssl = static_cast<SSL*>(ssl_);
  long verified = SSL_get_verify_result(ssl);
  std::string why = LastError();
  if (verified != X509_V_OK) {
    why = std::string("the peer's certificate is refused: ") +
          X509_verify_cert_error_string(verified);
  }
  return std::string("TLS: ") + what + " failed (" + why + ")";
}

void Session::Feed(const char* data, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  input_.append(data, size);
}

bool Session::Handshake() {
  std::lock_guard<std::mutex> lock(mu_);
  SSL* ssl = static_cast<SSL*>(ssl_);
  ERR_clear_error();
  int rc = SSL_do_handshake(ssl);
  if (rc == 1) return true;
  int error = SSL_get_error(ssl, rc);
  if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) return false;
  throw std::runtime_error(Error("the handshake"));
}

long Session::Read(char* out, size_t room) {
  std::lock_guard<std::mutex> lock(mu_);
  SSL* ssl = static_cast<SSL*>(ssl_);
  if (input_.size() == input_at_ && SSL_pending(ssl) == 0) return 0;  // nothing to read
  ERR_clear_error();
  int rc = SSL_read(ssl, out, static_cast<int>(std::min<size_t>(room, INT_MAX)));
  if (rc > 0) return rc;
  int error = SSL_get_error(ssl, rc);
  if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) return 0;
  if (error == SSL_ERROR_ZERO_RETURN) return -1;
  throw std::runtime_error(Error(SSL_is_init_finished(ssl) ? "a read" : "the handshake"));
}

void Session::Write(const char* data, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  SSL* ssl = static_cast<SSL*>(ssl_);
  while (size > 0) {
    ERR_clear_error();
    int rc = SSL_write(ssl, data, static_cast<int>(std::min<size_t>(size, 1 << 30)));
    if (rc <= 0) throw std::runtime_error(Error("a write"));
    data += rc;
    size -= static_cast<size_t>(rc);
  }
}

bool Session::TakeOutput(std::string* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (output_.empty()) return false;
  if (out->empty()) {
    out->swap(output_);
  } else {
    out->append(output_);
  }
  output_.clear();
  return true;
}

bool Session::HasOutput() {
  std::lock_guard<std::mutex> lock(mu_);
  return !output_.empty();
}

#else  // without OpenSSL: no TLS

namespace {
[[noreturn]] void Unavailable() {
  throw std::runtime_error(
      "TLS: this build of elastic_emb has no TLS (OpenSSL was not found when it was built)");
}
}  // namespace

std::shared_ptr<Context> Context::Server(const std::string&, const std::string&,
                                         const std::string&) {
  Unavailable();
}
std::shared_ptr<Context> Context::Client(const std::string&, const std::string&,
                                         const std::string&) {
  Unavailable();
}
Context::~Context() {}
Session::Session(std::shared_ptr<Context>, const std::string&) { Unavailable(); }
Session::~Session() {}
std::string Session::Error(const char*) { return ""; }
void Session::Feed(const char*, size_t) {}
bool Session::Handshake() { Unavailable(); }
long Session::Read(char*, size_t) { Unavailable(); }
void Session::Write(const char*, size_t) { Unavailable(); }
bool Session::TakeOutput(std::string*) { return false; }
bool Session::HasOutput() { return false; }

#endif

}  // namespace tls
}  // namespace elastic_emb
