//! `llm-ratelimit package-wasm --out DIR`: the filter's `.wasm` as an OCI image in an OCI
//! image layout, the format Istio's `WasmPlugin` and Envoy Gateway's
//! `EnvoyExtensionPolicy` pull. It is the Wasm image spec's *compat* variant (the one
//! standard registries and tools carry as an ordinary image): one
//! `application/vnd.oci.image.layer.v1.tar+gzip` layer holding `plugin.wasm`, and the
//! manifest annotation `module.wasm.image/variant: compat`. Push it with any OCI tool
//! (`skopeo copy oci:DIR:TAG docker://…`, `oras cp --from-oci-layout DIR:TAG …`,
//! `crane push DIR …`). The archive is reproducible: same module, same digests.

use flate2::write::GzEncoder;
use flate2::{Compression, GzBuilder};
use oci_spec::image::{
    Arch, Descriptor, DescriptorBuilder, ImageConfigurationBuilder, ImageIndexBuilder, ImageManifestBuilder, MediaType,
    OciLayoutBuilder, Os, RootFsBuilder, Sha256Digest,
};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;

/// The file name the Wasm image spec's compat variant requires in the layer.
pub const PLUGIN_FILE: &str = "plugin.wasm";
/// The manifest annotation that marks the compat variant with an OCI layer media type.
pub const VARIANT_ANNOTATION: (&str, &str) = ("module.wasm.image/variant", "compat");
const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Package the filter's .wasm as an OCI image (Istio WasmPlugin / Envoy Gateway format).
#[derive(clap::Args)]
pub struct Args {
    /// The filter module.
    #[arg(long, default_value = "target/wasm32-unknown-unknown/wasm/llm_ratelimit.wasm")]
    wasm: PathBuf,
    /// Directory to write the OCI image layout into (created if absent; must hold no layout yet).
    #[arg(long)]
    out: PathBuf,
    /// The tag the image gets in the layout's index (`org.opencontainers.image.ref.name`).
    #[arg(long, default_value = "latest")]
    tag: String,
}

pub fn run(args: &Args) -> ExitCode {
    match package(&args.wasm, &args.out, &args.tag) {
        Ok(manifest) => {
            println!("{}: OCI image layout, tag {}, manifest {manifest}", args.out.display(), args.tag);
            println!(
                "push it with e.g.: skopeo copy oci:{}:{} docker://REGISTRY/llm-ratelimit:{}",
                args.out.display(),
                args.tag,
                args.tag
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("package-wasm: {error}");
            ExitCode::FAILURE
        }
    }
}

/// A blob as content-addressed storage knows it.
struct Blob {
    bytes: Vec<u8>,
    hex: String,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Blob {
        let hex = sha256_hex(&bytes);
        Blob { bytes, hex }
    }

    fn descriptor(
        &self,
        media_type: MediaType,
        annotations: Option<HashMap<String, String>>,
    ) -> Result<Descriptor, String> {
        let digest = Sha256Digest::from_str(&self.hex).map_err(|e| e.to_string())?;
        let mut builder =
            DescriptorBuilder::default().media_type(media_type).digest(digest).size(self.bytes.len() as u64);
        if let Some(annotations) = annotations {
            builder = builder.annotations(annotations);
        }
        builder.build().map_err(|e| e.to_string())
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes the layout; returns the manifest's digest.
pub fn package(wasm: &Path, out: &Path, tag: &str) -> Result<String, String> {
    let module = std::fs::read(wasm).map_err(|e| format!("cannot read {}: {e}", wasm.display()))?;
    if !module.starts_with(b"\0asm") {
        return Err(format!("{} is not a WebAssembly module", wasm.display()));
    }
    if out.join("index.json").exists() {
        return Err(format!("{} already holds an image layout", out.display()));
    }
    let tar = layer_tar(&module)?;
    let diff_id = format!("sha256:{}", sha256_hex(&tar));
    let layer = Blob::new(gzip(&tar)?);

    let rootfs = RootFsBuilder::default().typ("layers").diff_ids(vec![diff_id]).build().map_err(|e| e.to_string())?;
    // A proxy-wasm module: wasm, for no operating system (the target is wasm32-unknown-unknown).
    let config = ImageConfigurationBuilder::default()
        .architecture(Arch::Wasm)
        .os(Os::Other("unknown".into()))
        .rootfs(rootfs)
        .build()
        .map_err(|e| e.to_string())?;
    let config = Blob::new(serde_json::to_vec(&config).map_err(|e| e.to_string())?);

    let annotations = HashMap::from([(VARIANT_ANNOTATION.0.to_string(), VARIANT_ANNOTATION.1.to_string())]);
    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(config.descriptor(MediaType::ImageConfig, None)?)
        .layers(vec![layer.descriptor(MediaType::ImageLayerGzip, None)?])
        .annotations(annotations)
        .build()
        .map_err(|e| e.to_string())?;
    let manifest = Blob::new(serde_json::to_vec(&manifest).map_err(|e| e.to_string())?);

    let tagged = HashMap::from([(REF_NAME.to_string(), tag.to_string())]);
    let index = ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageIndex)
        .manifests(vec![manifest.descriptor(MediaType::ImageManifest, Some(tagged))?])
        .build()
        .map_err(|e| e.to_string())?;
    let layout = OciLayoutBuilder::default().image_layout_version("1.0.0").build().map_err(|e| e.to_string())?;

    let blobs = out.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(|e| format!("cannot create {}: {e}", blobs.display()))?;
    for blob in [&layer, &config, &manifest] {
        write(&blobs.join(&blob.hex), &blob.bytes)?;
    }
    write(&out.join("oci-layout"), &serde_json::to_vec(&layout).map_err(|e| e.to_string())?)?;
    write(&out.join("index.json"), &serde_json::to_vec(&index).map_err(|e| e.to_string())?)?;
    Ok(format!("sha256:{}", manifest.hex))
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), String> {
    std::fs::write(path, bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// A tar holding the module as `plugin.wasm`, with fixed metadata so the digest depends
/// on the module alone.
fn layer_tar(module: &[u8]) -> Result<Vec<u8>, String> {
    let mut header = tar::Header::new_ustar();
    header.set_size(module.len() as u64);
    header.set_mode(0o644);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_entry_type(tar::EntryType::Regular);
    let mut archive = tar::Builder::new(Vec::new());
    archive.append_data(&mut header, PLUGIN_FILE, module).map_err(|e| e.to_string())?;
    archive.into_inner().map_err(|e| e.to_string())
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>, String> {
    // GzBuilder writes mtime 0 unless told otherwise: reproducible.
    let mut encoder: GzEncoder<Vec<u8>> = GzBuilder::new().write(Vec::new(), Compression::best());
    encoder.write_all(bytes).map_err(|e| e.to_string())?;
    encoder.finish().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::read::GzDecoder;
    use serde_json::Value;
    use std::io::Read;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0 a module of sorts";

    fn read_json(path: &Path) -> Value {
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    /// Reads a blob by its descriptor, checking the digest and size the descriptor gives.
    fn blob(layout: &Path, descriptor: &Value) -> Vec<u8> {
        let digest = descriptor["digest"].as_str().unwrap();
        let hex = digest.strip_prefix("sha256:").unwrap();
        let bytes = std::fs::read(layout.join("blobs/sha256").join(hex)).unwrap();
        assert_eq!(sha256_hex(&bytes), hex, "content matches its address");
        assert_eq!(descriptor["size"].as_u64(), Some(bytes.len() as u64));
        bytes
    }

    #[test]
    fn the_layout_holds_a_compat_wasm_image_whose_digests_match() {
        let dir = tempfile::tempdir().unwrap();
        let wasm = dir.path().join("m.wasm");
        std::fs::write(&wasm, MODULE).unwrap();
        let out = dir.path().join("image");
        let digest = package(&wasm, &out, "v1").unwrap();

        assert_eq!(read_json(&out.join("oci-layout"))["imageLayoutVersion"], "1.0.0");
        let index = read_json(&out.join("index.json"));
        assert_eq!(index["schemaVersion"], 2);
        assert_eq!(index["mediaType"], "application/vnd.oci.image.index.v1+json");
        let entry = &index["manifests"][0];
        assert_eq!(entry["mediaType"], "application/vnd.oci.image.manifest.v1+json");
        assert_eq!(entry["digest"], digest.as_str());
        assert_eq!(entry["annotations"][REF_NAME], "v1");

        let manifest: Value = serde_json::from_slice(&blob(&out, entry)).unwrap();
        assert_eq!(manifest["annotations"]["module.wasm.image/variant"], "compat");
        assert_eq!(manifest["config"]["mediaType"], "application/vnd.oci.image.config.v1+json");
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1);
        assert_eq!(layers[0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip");

        let mut tar = Vec::new();
        GzDecoder::new(&blob(&out, &layers[0])[..]).read_to_end(&mut tar).unwrap();
        let config: Value = serde_json::from_slice(&blob(&out, &manifest["config"])).unwrap();
        assert_eq!(config["rootfs"]["diff_ids"][0], format!("sha256:{}", sha256_hex(&tar)));
        assert_eq!(config["architecture"], "wasm");
        let mut archive = tar::Archive::new(&tar[..]);
        let mut entries = archive.entries().unwrap();
        let mut entry = entries.next().unwrap().unwrap();
        assert_eq!(entry.path().unwrap().to_str(), Some(PLUGIN_FILE));
        let mut module = Vec::new();
        entry.read_to_end(&mut module).unwrap();
        assert_eq!(module, MODULE);
        assert!(entries.next().is_none(), "one file only");

        // Reproducible: the same module gives the same manifest.
        assert_eq!(package(&wasm, &dir.path().join("again"), "v1").unwrap(), digest);
    }

    #[test]
    fn refuses_what_is_not_a_module_and_an_existing_layout() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("x.wasm");
        std::fs::write(&text, b"hello").unwrap();
        assert!(package(&text, &dir.path().join("o"), "t").unwrap_err().contains("not a WebAssembly module"));
        let wasm = dir.path().join("m.wasm");
        std::fs::write(&wasm, MODULE).unwrap();
        package(&wasm, &dir.path().join("o"), "t").unwrap();
        assert!(package(&wasm, &dir.path().join("o"), "t").unwrap_err().contains("already holds"));
        assert!(package(&dir.path().join("missing"), &dir.path().join("p"), "t").is_err());
    }
}
